"""What the serving engines themselves leave on a node (vLLM, SGLang, NCCL, CUDA), judged as exactly as our own state.

kvcached's own state (segments, socket directories) is one deployment's, and
its evidence is shared by the deployment (decide.py, settle). The engines'
leftovers are not kvcached deployments: each entry stands on its own
evidence (docs/NODE.md §6), with the same house rules and the same
scan → facts → decide → guarded act path (docs/CLEANER.md §3).

Modules, in the order a run uses them:

- `families`: the name patterns, each as tight as the real names allow, and
  the evidence each family carries (`Evidence`): users only (vLLM buffers,
  NCCL, CUDA IPC: live while a process maps it or holds it open), a creator
  PID in the name as well (SGLang), or a bound socket (vLLM's and SGLang's
  ZMQ IPC). A name that matches no family is never looked at again. The kinds (`EngineKind`)
  and engines (`Engine`) are the node layer's enums (kvcached/node/base/enums.py).
- `scan`: one listing of /dev/shm and of each RPC directory (/tmp, or
  VLLM_RPC_BASE_PATH) through directory fds, never following a link; one
  `EngineCandidate` per matching name, with its identity, file handle, owner,
  mode, links, allocated bytes (st_blocks × 512, what the entry really holds),
  mtime, ctime, and for a socket node the passive bind test (sockdiag.bound)
  when no listing shows it. Names that kvcached's own scan ties to a
  deployment (a socket directory, a process's KVCACHED_IPC_NAME, a 24-byte
  file with our mark or upstream's shape) are plain gc's, never candidates.
- `evidence`: `gather_engine_evidence(facts, candidates)` asks the /proc facts
  what only the engine pass needs, once: every process's maps matched by the
  device of the scanned files (Facts.map_users, one read that also serves
  plain gc's lazy maps pass), the open files the main pass identified
  through every descriptor (ProcessInfo.held_files), the PIDs every process has in each PID
  namespace (Facts.namespace_pids, read only when a name carries a PID), the
  listeners by file identity, the processes we could not read, and whether
  this /proc can show every process at all (a container's own procfs
  cannot, unless the caller vouches for it; hidepid).
- `decide`: `decide_engine(candidate, evidence, policy, now)`, a pure function
  tested as a table: foreign (symlink, wrong type, hard link, mount point,
  another user's), live (mapped, held, creator alive, listening, bound),
  unknown (an incomplete view, a blind spot, a failed bind test), young
  (inside the grace age), stale (unused, creator gone, PID reused, not
  listening); what it shares with kvcached's decision (the foreign checks,
  the socket decision, the grace age) is clean/rules.py's. `settle_groups`
  lets a live member of a multi-file region keep the others (rules.raise_groups).
- `act`: `plan_engines` (scan, facts, evidence, then `decide_engines`:
  decisions, regions, filters; no side effect), an `EnginePlan`: a
  cleanup.SourcePlan like kvcached's own, so
  cleanup.execute acts on it with the one guarded act (the parent directory
  re-opened and its identity compared, the entry re-opened without following
  and its identity, file handle, owner and link count re-checked, an flock
  taken, then unlinkat through the directory fd; dry run is the same path
  with one guard at the syscall). Its entries are report.Entry, decided as
  report.Decision with an `EngineReason`, and report the gc entry fields plus
  `engine` and `bytes` (kvctl/schemas/engine_entry.json);
  metrics.render_engines turns their part of a report into textfile metrics.

Plain gc (cleanup.plan) never calls into this package, so it costs what it
cost before; the full maps pass runs only when engine state is asked for.
A run that wants both passes one Facts to both plans: one /proc pass. The
package imports none of its modules: each caller imports the module that
holds what it needs (plain gc's hint, present.engine_leftover_count, loads
the name patterns alone).
"""
