"""The libraries the tests use import as installed: in a fresh interpreter, with no stub or shim.

torchvision's PyPI wheel is built against the CUDA torch and fails to import beside the CPU build
(``operator torchvision::nms does not exist``); timm imports torchvision, and transformers imports it
when it is installed.  The test extra installs neither, and any of them that is installed must import.
"""

import importlib.util
import subprocess
import sys

import pytest

IMPORTS = {
    "transformers": "import transformers; from transformers import LlamaConfig, LlamaForCausalLM, ResNetConfig",
    "timm": "import timm; timm.create_model('resnet18', pretrained=False)",
    "torchvision": "import torchvision",
    "lightning": "import lightning",
    "accelerate": "import accelerate",
}


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@pytest.fixture(scope="module")
def imports(tmp_path_factory):
    """Each installed library's import, all started at once (each in an interpreter of its own): the waits
    overlap.  -I: no PYTHON* variables, no user site-packages, nothing of the tests' own on sys.path."""
    folder = tmp_path_factory.mktemp("clean")
    running = {name: subprocess.Popen([sys.executable, "-I", "-c", code], cwd=folder, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
               for name, code in IMPORTS.items() if _installed(name)}
    yield running
    for process in running.values():
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.mark.parametrize("name", list(IMPORTS))
def test_an_installed_library_imports_in_a_clean_interpreter(name, imports):
    if name not in imports:
        pytest.skip(f"{name} is not installed")
    _, stderr = imports[name].communicate(timeout=300)
    assert imports[name].returncode == 0, stderr[-2000:]
