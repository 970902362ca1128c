"""SGLang 0.5.23's plugin mechanism: entry points, the SGLANG_PLUGINS allow-list, HookRegistry, a plugin that raises.

A real distribution (a .dist-info with an entry_points.txt) on the child's
path registers two plugins in the `sglang.srt.plugins` group, as pip would;
each case runs `load_plugins()` in a process of its own, because SGLang's
hooks cannot be taken back once applied: `python -c` forked from the zygote
(tests/sglang/zygote.py), which imported SGLang and never loaded a plugin, so
the import is paid once.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sglang.cpu_env import last_json
from tests.sglang.serves import Forked

pytestmark = pytest.mark.sglang

PLUGIN = '''
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

CALLS = []


def around_kill(original, *args, **kwargs):
    CALLS.append(("kill_process_tree", args))
    return None  # stands in for the real thing: nothing is killed


def after_alloc(result, self, need_size):
    CALLS.append(("alloc", need_size))


def around_launch(original, cls, *args, **kwargs):
    CALLS.append(("launch", cls.__name__))
    return original(cls, *args, **kwargs)


def register():
    HookRegistry.register("sglang.srt.utils.common.kill_process_tree", around_kill, HookType.AROUND)
    HookRegistry.register("sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator.alloc", after_alloc,
                          HookType.AFTER)
    HookRegistry.register("sglang.srt.entrypoints.engine.Engine._launch_scheduler_processes", around_launch,
                          HookType.AROUND)


def raises():
    HookRegistry.register("sglang.srt.utils.common.get_bool_env_var", lambda name, default="false": None,
                          HookType.BEFORE)
    raise RuntimeError("kvtest plugin fails on purpose")
'''

CHILD = '''
import json, logging, sys
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("sglang.srt.plugins").addHandler(Keep())
logging.getLogger("sglang.srt.plugins").setLevel(logging.INFO)

import sglang.srt.entrypoints.engine as engine  # holds `from sglang.srt.utils import kill_process_tree`
import sglang.srt.utils as utils
import sglang.srt.utils.common as common
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry

original_kill = common.kill_process_tree  # a module-level alias, as any module could hold
KEEP = {"kill": common.kill_process_tree}  # held inside a container: out of HookRegistry's reach
load_plugins()
load_plugins()  # a second call does nothing

executed = sorted(m.split(": ")[1] for m in records if m.startswith("Executed general plugin"))
failed = sorted(m.rsplit(" ", 1)[1] for m in records if m.startswith("Failed to execute general plugin"))
skipped = sorted(m.split(" ")[2] for m in records if m.startswith("Skipping plugin"))
load_failed = sorted(m.split(" ")[4] for m in records if m.startswith("Failed to load plugin"))
report = {"executed": executed, "failed": failed, "skipped": skipped, "load_failed": load_failed,
          "patched": sorted(HookRegistry._patched)}
if "kvtest_hooks" in executed:
    import kvtestplug
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    engine.kill_process_tree(12345, include_parent=False)
    TokenToKVPoolAllocator(8, dtype=torch.float16, device="cpu", kvcache=None, need_sort=False).alloc(3)
    raw = engine.Engine.__dict__["_launch_scheduler_processes"]
    report.update(
        calls=[list(c[:1]) + [list(c[1]) if isinstance(c[1], tuple) else c[1]] for c in kvtestplug.CALLS],
        rebound=[mod.kill_process_tree is common.kill_process_tree for mod in (engine, utils)],
        wrapped_original=common.kill_process_tree.__wrapped__ is KEEP["kill"],
        alias_rebound=original_kill is common.kill_process_tree,
        name=common.kill_process_tree.__name__,
        classmethod_kept=isinstance(raw, classmethod),
    )
print(json.dumps(report))
'''


def _plugin_dir(path: Path, module: str = PLUGIN) -> str:
    """`path` holding an installed-looking distribution `kvtestplug` with two sglang.srt.plugins entry points."""
    (path / "kvtestplug.py").write_text(module)
    info = path / "kvtestplug-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvtestplug\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""\
        [sglang.srt.plugins]
        kvtest_hooks = kvtestplug:register
        kvtest_raises = kvtestplug:raises
    """))
    return str(path)


# kvcached's own entry point (pyproject.toml), installed in this venv: a plugin of the group like the test's.
# kvcached is not enabled in these children, so it runs and does nothing.
KVCACHED = "kvcached"

ALLOW_CASES = {
    "kvtest_hooks": {"executed": ["kvtest_hooks"], "skipped": [KVCACHED, "kvtest_raises"]},
    " kvtest_raises , other ": {"executed": [], "skipped": [KVCACHED, "kvtest_hooks"]},
    "": {"executed": [KVCACHED, "kvtest_hooks"], "skipped": []},
    ",": {"executed": [], "skipped": [KVCACHED, "kvtest_hooks", "kvtest_raises"]},
}


@pytest.fixture(scope="module")
def children(zygote, sgl_scratch, tmp_path_factory) -> Iterator[dict[str, Forked]]:
    """Each case's process, all started at once; each test reads its own.

    The broken case has a directory of its own, whose module fails to import.
    """
    from tests.sglang.cpu_env import child_env

    good = _plugin_dir(tmp_path_factory.mktemp("plugin"))
    broken = _plugin_dir(tmp_path_factory.mktemp("plugin-broken"), "raise ImportError('broken on purpose')\n")

    def start(code: str, path: str, allow: str | None = None) -> Forked:
        extra = {"PYTHONPATH": path + ":" + child_env(sgl_scratch)["PYTHONPATH"]}
        if allow is not None:
            extra["SGLANG_PLUGINS"] = allow
        return Forked(zygote, code, sgl_scratch, extra=extra)

    started = {"all": start(CHILD, good), "raises": start(CHILD, good, allow="kvtest_raises"),
               "allow-lists": start(ALLOW_LISTS.replace("CASES", repr(list(ALLOW_CASES))), good),
               "broken": start(CHILD, broken)}
    yield started
    for child in started.values():
        child.close()


def test_every_plugin_of_the_group_runs_and_its_hooks_reach_stale_from_imports(children) -> None:
    """Without SGLANG_PLUGINS both run; the hooks apply, also to `from ... import` bindings made before them.

    The rebinding walks every module in sys.modules: a module-level alias of
    the original (a patch kit's saved "original", say) is rewritten to the
    wrapper too; only a reference inside a container keeps the original.
    """
    report = last_json(children["all"].result())
    assert report["executed"] == [KVCACHED, "kvtest_hooks"]
    assert report["failed"] == ["kvtest_raises"]
    assert report["calls"] == [["kill_process_tree", [12345]], ["alloc", 3]]
    assert report["rebound"] == [True, True]
    assert report["wrapped_original"] is True and report["name"] == "kill_process_tree"
    # Every module-level name bound to the original is rebound, __main__'s own alias included.
    assert report["alias_rebound"] is True
    assert report["classmethod_kept"] is True


def test_a_plugin_that_raises_is_logged_and_the_hooks_it_registered_still_apply(children) -> None:
    """The exception is logged ("Failed to execute general plugin") and start-up goes on; what it registered stays."""
    report = last_json(children["raises"].result())
    assert report["executed"] == [] and report["failed"] == ["kvtest_raises"]
    assert report["patched"] == ["sglang.srt.utils.common.get_bool_env_var"]


ALLOW_LISTS = '''
import json, logging, os
import sglang.srt.plugins as plugins
from sglang.srt.plugins.hook_registry import HookRegistry

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("sglang.srt.plugins").addHandler(Keep())
logging.getLogger("sglang.srt.plugins").setLevel(logging.INFO)
out = {}
for allow in CASES:
    os.environ["SGLANG_PLUGINS"] = allow
    records.clear()
    plugins._plugins_loaded = False  # SGLang's once-per-process guard, reset between cases
    HookRegistry.reset()
    plugins.load_plugins()
    out[allow] = {
        "executed": sorted(m.split(": ")[1] for m in records if m.startswith("Executed general plugin")),
        "skipped": sorted(m.split(" ")[2] for m in records if m.startswith("Skipping plugin")),
    }
print(json.dumps(out))
'''


def test_sglang_plugins_is_a_comma_separated_allow_list_of_entry_point_names(children) -> None:
    """Names are stripped; empty means no list (all run); only commas allow nothing. Read at each load."""
    assert last_json(children["allow-lists"].result()) == ALLOW_CASES


def test_a_plugin_whose_module_fails_to_import_is_logged_and_skipped(children) -> None:
    """ep.load() raising is logged ("Failed to load plugin ...") per entry point; nothing runs, start-up goes on."""
    report = last_json(children["broken"].result())
    assert report["load_failed"] == ["kvtest_hooks", "kvtest_raises"]
    assert report["executed"] == [KVCACHED] and report["patched"] == []
