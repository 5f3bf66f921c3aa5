"""The NVML binding is found in vLLM's runtime venv when it is not importable."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from qwen4090.probes import nvml_binding

FAKE_PYNVML = "NVML_SUCCESS = 0\ndef nvmlInit():\n    raise OSError('no driver here')\n"


def fake_venv(root: Path, rel: str, text: str = FAKE_PYNVML) -> Path:
    f = root / "lib" / "python3.11" / "site-packages" / rel
    f.parent.mkdir(parents=True)
    f.write_text(text)
    return root


@pytest.fixture(autouse=True)
def restore_pynvml() -> Iterator[None]:
    """Leave sys.modules['pynvml'] as it was: other tests must not see our loaded copy."""
    had, old = "pynvml" in sys.modules, sys.modules.get("pynvml")
    yield
    if had:
        sys.modules["pynvml"] = old  # type: ignore[assignment]
    else:
        sys.modules.pop("pynvml", None)


@pytest.fixture
def no_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` fails


def test_loads_vllms_vendored_copy(tmp_path: Path, no_pynvml: None,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    venv = fake_venv(tmp_path / "venv", "vllm/third_party/pynvml.py")
    monkeypatch.delitem(sys.modules, "pynvml")
    monkeypatch.setattr(nvml_binding.importlib, "import_module",
                        lambda name: (_ for _ in ()).throw(ImportError(name)))
    mod = nvml_binding.load_pynvml(venv)
    assert mod is not None and mod.NVML_SUCCESS == 0
    assert mod.__file__ == str(venv / "lib/python3.11/site-packages/vllm/third_party/pynvml.py")


def test_prefers_nvidia_ml_py_over_the_vendored_copy(tmp_path: Path) -> None:
    venv = fake_venv(tmp_path / "venv", "vllm/third_party/pynvml.py")
    (venv / "lib/python3.11/site-packages/pynvml.py").write_text(FAKE_PYNVML)
    assert [p.name for p in nvml_binding.runtime_candidates(venv)] == ["pynvml.py", "pynvml.py"]
    assert nvml_binding.runtime_candidates(venv)[0].parent.name == "site-packages"


def test_none_without_any_binding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml_binding.importlib, "import_module",
                        lambda name: (_ for _ in ()).throw(ImportError(name)))
    assert nvml_binding.load_pynvml(tmp_path / "empty") is None
    broken = fake_venv(tmp_path / "broken", "pynvml.py", "raise RuntimeError('broken')\n")
    assert nvml_binding.load_pynvml(broken) is None


def test_venv_of() -> None:
    assert nvml_binding.venv_of("/opt/qwen4090/venv/bin/python") == Path("/opt/qwen4090/venv")


REAL_RUNTIME = Path(__file__).resolve().parents[2] / ".runtime" / "venv"


@pytest.mark.skipif(not nvml_binding.runtime_candidates(REAL_RUNTIME),
                    reason="no vLLM runtime venv (scripts/setup-runtime.sh)")
def test_the_real_runtime_has_one_that_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nvml_binding.importlib, "import_module",
                        lambda name: (_ for _ in ()).throw(ImportError(name)))
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    mod = nvml_binding.load_pynvml(REAL_RUNTIME)
    assert mod is not None and hasattr(mod, "nvmlInit")
    with pytest.raises(mod.NVMLError):  # no GPU driver on this machine
        mod.nvmlInit()


def test_a_second_venv_is_loaded_although_the_first_venvs_copy_sits_in_sys_modules(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian's python3 with /opt/qwen4090/venv present: the copy found there at import lands in
    sys.modules['pynvml'], and `import pynvml` then returns it for every later venv (seen in the
    system test's guest: a `plan` for another venv read /opt's binding)."""
    monkeypatch.delitem(sys.modules, "pynvml", raising=False)
    real_import = nvml_binding.importlib.import_module

    def debian_import(name: str) -> object:  # no pynvml on the path; sys.modules still counts
        if name == "pynvml" and sys.modules.get("pynvml") is None:
            raise ImportError(name)
        return real_import(name)

    monkeypatch.setattr(nvml_binding.importlib, "import_module", debian_import)
    first = nvml_binding.load_pynvml(fake_venv(tmp_path / "opt", "pynvml.py", FAKE_PYNVML))
    second_venv = fake_venv(tmp_path / "other", "pynvml.py", FAKE_PYNVML + "WHO = 'other'\n")
    second = nvml_binding.load_pynvml(second_venv)
    assert first is not None and second is not None
    assert second.__file__ == str(second_venv / "lib/python3.11/site-packages/pynvml.py")
    assert getattr(second, "WHO", None) == "other"
