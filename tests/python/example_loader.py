"""Loads a script of examples/ as a module, for the tests that run it."""

import importlib.util
import os
import sys

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples")


def load_example(folder: str, name: str):
    """examples/<folder>/<name>.py as the module `name` (registered in sys.modules, where a
    dataclass of the script looks its module up)."""
    spec = importlib.util.spec_from_file_location(
        name, os.path.join(EXAMPLES, folder, name + ".py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
