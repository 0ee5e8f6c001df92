"""More of gpuslice.nvml's promises that mutation testing showed no test held (the rest of
tests/test_nvml_mutation.py's, on its in-process FakePynvml).

A session is shut down (nvmlShutdown) only if it was initialised, and close() of one never
opened raises nothing; after close() the next open() initialises NVML afresh. forget() never
raises, even when the driver is gone and nvmlShutdown fails with it. reopen() says what
gpuslice does instead as open() does: "no GPUs" unless told.
"""

from __future__ import annotations

from gpuslice.nvml import Nvml, NvmlStatus
from tests.test_nvml_mutation import DRIVER, FALLBACK, FakePynvml
from tests.test_nvml_mutation import fake as fake

NOT_LOADED = (
    "NVML unavailable (NVIDIA driver not loaded): using {}. Hint: check `nvidia-smi` and "
    "`dmesg`, load the nvidia kernel module, or set gpus: in config.yaml"
)


def test_only_an_initialised_session_is_shut_down_and_close_starts_afresh(
    fake: FakePynvml,
) -> None:
    nvml = Nvml()
    nvml.close()  # never opened: nothing to shut down
    assert fake.calls == []
    assert nvml.open() == NvmlStatus(True, None, DRIVER)
    nvml.close()
    assert fake.calls == ["nvmlInit", "nvmlSystemGetDriverVersion", "nvmlShutdown"]
    assert nvml.open() == NvmlStatus(True, None, DRIVER)
    assert fake.calls[3:] == ["nvmlInit", "nvmlSystemGetDriverVersion"]


def test_forgetting_a_session_whose_driver_is_gone_raises_nothing(fake: FakePynvml) -> None:
    nvml = Nvml()
    nvml.open()
    fake.fail[("nvmlShutdown", None)] = 9
    nvml.forget()
    del fake.fail[("nvmlShutdown", None)]
    assert nvml.open() == NvmlStatus(True, None, DRIVER)
    assert fake.calls.count("nvmlInit") == 2


def test_reopen_says_what_gpuslice_does_instead(fake: FakePynvml) -> None:
    fake.fail[("nvmlInit", None)] = 9
    nvml = Nvml()
    assert nvml.reopen() == NvmlStatus(False, NOT_LOADED.format("no GPUs"))
    assert nvml.reopen(fallback=FALLBACK) == NvmlStatus(False, NOT_LOADED.format(FALLBACK))
