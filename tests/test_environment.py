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


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    # -I: no PYTHON* variables, no user site-packages, nothing of the tests' own on sys.path
    return subprocess.run([sys.executable, "-I", "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("name", list(IMPORTS))
def test_an_installed_library_imports_in_a_clean_interpreter(name, tmp_path):
    if not _installed(name):
        pytest.skip(f"{name} is not installed")
    done = _run(IMPORTS[name], tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]

