"""Child processes of the SGLang tests: declare the torchvision schemas before torchvision is imported.

On PYTHONPATH only in the environment tests/sglang gives its children
(tests/sglang/cpu_env.py), so that SGLang's spawned processes (schedulers,
detokenizer) import as the test process does. Lazy: torch is imported only
when something imports torchvision.
"""

import sys


class _DeclareBeforeTorchvision:
    """A meta-path finder that finds nothing: it only runs the declaration when torchvision is first looked up."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            from tests.sglang.torchvision_ops import declare

            declare()
        return None


sys.meta_path.insert(0, _DeclareBeforeTorchvision())
