"""Driver truth before vLLM starts (issue 31.5): a driver whose CUDA is older than the one the
runtime's torch was built for is refused by the preflight with one line and exit 78, instead of
five deaths at CUDA init and exit 75.

The pure comparison on plain values; the runtime's torch/version.py read as text from a fake
venv; NVML from tests/unit/fake_pynvml.py; and the joint from both to the supervisor's exit code.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
from test_gpu_joints import fake_venv, write_config
from test_supervisor import Harness
from tests.support.fakes import Log

from qwen4090.base.states import State
from qwen4090.commandline import cli
from qwen4090.decide import cudacompat
from qwen4090.decide.cudacompat import DriverCuda, TorchBuild
from qwen4090.decide.results import PreflightResult
from qwen4090.launching import gpu, runtime
from qwen4090.launching.launchvalue import Launch
from qwen4090.probes import nvml
from qwen4090.settings.config import Config, load

FAKE = Path(__file__).with_name("fake_pynvml.py")

# torch/version.py as torch 2.x writes it (a CUDA 12.8 wheel from PyPI), and a CPU build's
TORCH_CU128 = """from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'xpu']
__version__ = '2.8.0+cu128'
debug = False
cuda: Optional[str] = '12.8'
git_version = 'a1cb3cc05d46d198467bebbb6e8fba50a325d4e7'
hip: Optional[str] = None
xpu: Optional[str] = None
"""
TORCH_CPU = TORCH_CU128.replace("'2.8.0+cu128'", "'2.13.0+cpu'").replace(
    "cuda: Optional[str] = '12.8'", "cuda: Optional[str] = None")
DEBIAN_12 = DriverCuda("535.183.01", 12020)  # Debian 12's own driver: CUDA 12.2
VENV = Path("/opt/qwen4090/venv")


# --- the pure comparison ------------------------------------------------------------------------


def test_an_older_driver_is_refused_in_one_line_naming_both_and_the_fix() -> None:
    build = cudacompat.torch_build_of(TORCH_CU128)
    assert build == TorchBuild("2.8.0+cu128", "12.8")
    why = cudacompat.refusal(DEBIAN_12, build, VENV)
    assert why == ("driver 535.183.01 supports CUDA 12.2, but the runtime /opt/qwen4090/venv "
                   "(torch 2.8.0+cu128) needs CUDA 12.8: install an NVIDIA driver that supports "
                   "CUDA 12.8 (>= 570.26), or a runtime built for CUDA 12.2 or older "
                   "(qwen4090 install-runtime --vllm-version V --pip-arg=..., see README.Debian)")


@pytest.mark.parametrize("cuda, refused", [
    (12020, True), (12060, True), (12080, False), (12090, False), (13000, False)])
def test_the_driver_passes_from_the_runtimes_cuda_on(cuda: int, refused: bool) -> None:
    build = TorchBuild("2.8.0+cu128", "12.8")
    assert (cudacompat.refusal(DriverCuda("5xx", cuda), build, VENV) is not None) is refused


def test_minor_versions_compare_as_numbers_and_a_new_major_needs_a_new_driver() -> None:
    # 12.10 is newer than 12.9 (not "12.1"), and CUDA 13 is beyond every 12.x driver
    assert cudacompat.refusal(DriverCuda("x", 12100), TorchBuild(None, "12.9"), VENV) is None
    why = cudacompat.refusal(DriverCuda("575.51.03", 12090), TorchBuild(None, "13.0"), VENV)
    assert why is not None and "(torch) needs CUDA 13.0" in why and ">= 580.65.06" in why


def test_a_cuda_the_table_does_not_know_gets_no_driver_number() -> None:
    why = cudacompat.refusal(DEBIAN_12, TorchBuild("3.0.0+cu141", "14.1"), VENV)
    assert why is not None and "supports CUDA 14.1, or a runtime" in why and ">=" not in why


def test_a_cpu_build_needs_no_driver() -> None:
    build = cudacompat.torch_build_of(TORCH_CPU)
    assert build == TorchBuild("2.13.0+cpu", None)
    assert cudacompat.refusal(DEBIAN_12, build, VENV) is None


@pytest.mark.parametrize("text, found", [
    ("__version__ = '1.13.1+cu117'\ncuda = '11.7'\n", TorchBuild("1.13.1+cu117", "11.7")),
    ('cuda: Optional[str] = "12.4"  # set by the build\n', TorchBuild(None, "12.4")),
    ("cuda = None\n", TorchBuild(None, None)),
])
def test_version_py_spellings(text: str, found: TorchBuild) -> None:
    assert cudacompat.torch_build_of(text) == found


@pytest.mark.parametrize("text", ["", "__version__ = '2.8.0'\n", "cuda = '12.x'\n",
                                  "hip_cuda = '12.8'\n"])
def test_a_version_py_that_does_not_say_is_not_judged(text: str) -> None:
    assert isinstance(cudacompat.torch_build_of(text), str)


def test_nvmls_number_is_major_and_minor() -> None:
    assert DriverCuda("", 12020).supports == (12, 2)
    assert DriverCuda("", 13000).supports == (13, 0)
    assert DriverCuda("", 12100).supports == (12, 10)


# --- the facts: the venv's torch/version.py, NVML -------------------------------------------------


def runtime_venv(root: Path, version_py: str | None = TORCH_CU128) -> Path:
    """A runtime venv (pyvenv.cfg, bin/python, the fake pynvml in site-packages), with a torch
    whose version.py says ``version_py`` (None: no torch).  Returns its interpreter."""
    py = fake_venv(root)
    (root / "pyvenv.cfg").write_text("home = /usr/bin\n")
    if version_py is not None:
        torch = root / "lib" / "python3.11" / "site-packages" / "torch"
        torch.mkdir()
        (torch / "version.py").write_text(version_py)
    return py


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """tests/unit/fake_pynvml.py as the binding (a fresh copy): Debian 12's driver."""
    spec = importlib.util.spec_from_file_location("fake_pynvml_driver", FAKE)
    assert spec is not None and spec.loader is not None
    fake = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fake)
    fake.STATE.update(driver="535.183.01", cuda_driver=12020)
    monkeypatch.setattr(nvml, "pynvml", fake)
    monkeypatch.setattr(nvml, "_initialized", False)
    monkeypatch.setattr(nvml, "bind", lambda command: None)
    return fake


def test_the_runtimes_torch_is_read_as_text(tmp_path: Path) -> None:
    venv = runtime_venv(tmp_path / "venv").parent.parent
    assert runtime.torch_build(venv) == TorchBuild("2.8.0+cu128", "12.8")
    bare = runtime_venv(tmp_path / "bare", None).parent.parent
    assert "no torch/version.py" in str(runtime.torch_build(bare))


def test_nvml_says_the_drivers_cuda(fake_nvml: ModuleType) -> None:
    assert nvml.driver_cuda() == DriverCuda("535.183.01", 12020)
    del fake_nvml.nvmlSystemGetCudaDriverVersion_v2  # an older binding: the first name
    fake_nvml.STATE["cuda_driver"] = 12080
    assert nvml.driver_cuda() == DriverCuda("535.183.01", 12080)


def test_nvml_without_the_query_or_a_driver_says_why(fake_nvml: ModuleType,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    del fake_nvml.nvmlSystemGetCudaDriverVersion_v2
    del fake_nvml.nvmlSystemGetCudaDriverVersion
    assert "cannot ask" in str(nvml.driver_cuda())
    monkeypatch.setattr(nvml, "pynvml", None)
    assert "no NVML binding" in str(nvml.driver_cuda())


# --- the GPU part's check, and what the supervisor makes of it ----------------------------------


def check(cfg: Config) -> PreflightResult:
    parts = gpu.GpuParts(Log(), env={})
    res = PreflightResult()
    parts.check(parts.launch(cfg), res)
    return res


def cfg_with(tmp_path: Path, py: Path) -> Config:
    return load(write_config(tmp_path, py, gpu_keys="memory_gib = 139.8"))


def test_the_gpu_check_refuses_an_old_driver_as_a_config_error(
        tmp_path: Path, fake_nvml: ModuleType) -> None:
    py = runtime_venv(tmp_path / "venv")
    res = check(cfg_with(tmp_path, py))
    assert res.fatal is not None and res.transient is None
    line = str(res.fatal)
    assert "\n" not in line and line.startswith("driver 535.183.01 supports CUDA 12.2, but "
                                                f"the runtime {tmp_path / 'venv'} (torch "
                                                "2.8.0+cu128) needs CUDA 12.8")


@pytest.mark.parametrize("version_py", [TORCH_CPU, None, "cuda = 12.8\n"])
def test_a_cpu_build_or_an_unreadable_one_passes(tmp_path: Path, fake_nvml: ModuleType,
                                                 version_py: str | None) -> None:
    py = runtime_venv(tmp_path / "venv", version_py)
    assert check(cfg_with(tmp_path, py)).fatal is None


def test_a_new_enough_driver_passes(tmp_path: Path, fake_nvml: ModuleType) -> None:
    py = runtime_venv(tmp_path / "venv")
    for cuda in (12080, 13000):  # the same CUDA, and a newer one
        fake_nvml.STATE["cuda_driver"] = cuda
        assert check(cfg_with(tmp_path, py)).fatal is None


def test_without_nvml_nothing_is_judged(tmp_path: Path, fake_nvml: ModuleType,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    py = runtime_venv(tmp_path / "venv")
    monkeypatch.setattr(nvml, "pynvml", None)  # no binding: no GPU to speak of
    assert check(cfg_with(tmp_path, py)).fatal is None


def test_gpu_enabled_off_skips_the_check(tmp_path: Path, fake_nvml: ModuleType) -> None:
    py = runtime_venv(tmp_path / "venv")
    cfg = load(write_config(tmp_path, py, gpu_keys='enabled = "off"'))
    assert check(cfg).fatal is None


def test_the_daemons_preflight_refuses_before_any_launch(tmp_path: Path,
                                                         fake_nvml: ModuleType) -> None:
    """What cli.cmd_run hands the supervisor (GpuParts.preflight: the static checks, the GPU's,
    the port), and the supervisor's verdict on it: exit 78, vLLM never spawned, the line in
    the journal."""
    py = runtime_venv(tmp_path / "venv")
    cfg = cfg_with(tmp_path, py)
    parts = gpu.GpuParts(Log(), env={})
    res = parts.preflight(parts.launch(cfg))
    assert res.fatal is not None and "needs CUDA 12.8" in str(res.fatal)

    def preflight(chosen: Launch) -> PreflightResult:
        return parts.preflight(parts.launch(cfg))

    h = Harness(preflight=preflight)
    h.step()
    assert h.sup.state == State.FAILED and h.sup.exit_code == 78 and not h.children
    said = h.log.named("giving_up")
    assert said and said[0]["reason"] == str(res.fatal)


def test_plan_shows_both_and_exits_78_when_the_preflight_would_refuse(
        tmp_path: Path, fake_nvml: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    py = runtime_venv(tmp_path / "venv")
    conf = write_config(tmp_path, py, gpu_keys="memory_gib = 139.8")
    assert cli.main(["plan", "-c", str(conf)]) == 78
    assert "cuda      refused: driver 535.183.01 supports CUDA 12.2" in capsys.readouterr().out
    fake_nvml.STATE["cuda_driver"] = 13000
    assert cli.main(["plan", "-c", str(conf)]) == 0
    assert (f"cuda      driver 535.183.01 supports CUDA 13.0; runtime {tmp_path / 'venv'} "
            "(torch 2.8.0+cu128) built for CUDA 12.8") in capsys.readouterr().out
    assert cli.main(["plan", "-c", str(conf), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["cuda"]
    assert out == {"driver": "535.183.01", "driver_cuda": "13.0",
                   "runtime": str(tmp_path / "venv"), "torch": "2.8.0+cu128",
                   "torch_cuda": "12.8", "refused": None}
