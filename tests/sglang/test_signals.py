"""SGLang 0.5.23's main-process signal paths: SubprocessWatchdog and SignalHandler, with real children and signals.

Each case is a process of its own (signal handlers are process-wide):
`python -c` forked from the zygote (tests/sglang/zygote.py), which imported
SGLang once; its children are spawned, as SGLang's are.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator

import psutil
import pytest

from tests.sglang.cpu_env import last_json
from tests.sglang.serves import Forked
from tests.waiting import wait_for

pytestmark = pytest.mark.sglang

WATCHDOG = '''
import json, multiprocessing as mp, os, signal, sys, time
from sglang.srt.utils.watchdog import SubprocessWatchdog
from tests.waiting import wait_until

got = []
signal.signal(signal.SIGQUIT, lambda signum, frame: got.append(signum))
ctx = mp.get_context("spawn")
procs = [ctx.Process(target=time.sleep, args=(0.3,))]
if sys.argv[1] == "crash":
    procs.append(ctx.Process(target=os._exit, args=(3,)))
for p in procs:
    p.start()
watchdog = SubprocessWatchdog(procs, [f"child{i}" for i in range(len(procs))], interval=0.1)
watchdog.start()
for p in procs:
    p.join()
wait_until(lambda: got, 3, interval=0.05)
watchdog.stop()
print(json.dumps({"sigquit": got, "exitcodes": [p.exitcode for p in procs]}))
'''


@pytest.fixture(scope="module")
def children(zygote, sgl_scratch) -> Iterator[dict[str, Forked]]:
    """The module's three processes, started together; each test takes its own.

    The SignalHandler one waits for its signals until its test sends them.
    """
    started = {mode: Forked(zygote, WATCHDOG.replace("sys.argv[1]", repr(mode)), sgl_scratch)
               for mode in ("clean", "crash")}
    started["handler"] = Forked(zygote, SIGNAL_HANDLER, sgl_scratch)
    try:
        yield started
    finally:
        for child in started.values():
            child.close()


@pytest.mark.parametrize(("mode", "sigquit", "exitcodes"), [
    ("clean", [], [0]),
    ("crash", [signal.SIGQUIT], [0, 3]),
])
def test_subprocess_watchdog_sigquits_its_own_process_when_a_child_exits_nonzero(children, mode, sigquit,
                                                                                 exitcodes) -> None:
    """A child that exits 0 is fine; one that exits otherwise makes the watchdog SIGQUIT the process it runs in."""
    assert last_json(children[mode].result()) == {"sigquit": sigquit, "exitcodes": exitcodes}


SIGNAL_HANDLER = '''
import json, multiprocessing as mp, signal, sys, time
from sglang.srt.managers.tokenizer_manager import SignalHandler
from sglang.srt.utils.watchdog import SubprocessWatchdog


class TokenizerManagerStandIn:
    """What SignalHandler reads and calls on its TokenizerManager, and nothing else (a real one needs a tokenizer)."""

    gracefully_exit = False

    def __init__(self, watchdog):
        self._subprocess_watchdog = watchdog

    def dump_requests_before_crash(self):
        print(json.dumps({"dumped": True, "watchdog_stopped": self._subprocess_watchdog._thread is None}), flush=True)


child = mp.get_context("spawn").Process(target=time.sleep, args=(600,))
child.start()
watchdog = SubprocessWatchdog([child], ["child"], interval=0.2)
watchdog.start()
tm = TokenizerManagerStandIn(watchdog)
handler = SignalHandler(tm)
signal.signal(signal.SIGTERM, handler.sigterm_handler)
signal.signal(signal.SIGQUIT, handler.running_phase_sigquit_handler)
print(json.dumps({"child": child.pid}), flush=True)
while not tm.gracefully_exit:
    time.sleep(0.05)
print(json.dumps({"gracefully_exit": True}), flush=True)
while True:
    time.sleep(1)
'''


def _lines(proc: Forked, count: int, timeout: float) -> list[dict]:
    """The first `count` lines `proc` printed, once it printed them (fails with its stderr if it exits first)."""
    def printed() -> bool:
        return len(proc.stdout().splitlines()) >= count or proc.zygote.status(proc.key, 0) is not None

    wait_for(printed, timeout=timeout, interval=0.05)
    lines = proc.stdout().splitlines()
    assert len(lines) >= count, (lines, proc.err_path.read_text()[-3000:])
    return [json.loads(line) for line in lines[:count]]


def test_signal_handler_sigterm_only_asks_to_drain_and_sigquit_kills_the_tree_and_main(children) -> None:
    """SIGTERM sets gracefully_exit, nothing else; SIGQUIT stops the watchdog, dumps, SIGKILLs children and main."""
    proc = children["handler"]
    child = _lines(proc, 1, 400)[0]["child"]
    os.kill(proc.pid, signal.SIGTERM)
    assert _lines(proc, 2, 60)[1] == {"gracefully_exit": True}
    assert proc.zygote.status(proc.key, 0) is None and psutil.pid_exists(child)
    os.kill(proc.pid, signal.SIGQUIT)
    assert proc.wait(60) == -signal.SIGKILL
    assert _lines(proc, 3, 0)[2] == {"dumped": True, "watchdog_stopped": True}
    wait_for(lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE,
             timeout=20)
