from unittest import mock

import pytest

from hetsim.errors import ClusterSpecError, UnknownNameError
from hetsim.hardware.cluster import GiB, detect_cuda, parse_cluster, parse_size


def test_emulated_spec():
    c = parse_cluster("emu:1.0@4G,0.5@512M")
    assert c.emulated and c.source == "emulated"
    assert [d.speed for d in c.devices] == [1.0, 0.5]
    assert c.devices[1].memory_bytes == 512 * 2**20


def test_catalog_spec_counts_and_labels():
    c = parse_cluster("catalog:rtx_3090,gtx_1080_ti*2,t4")
    assert [d.kind for d in c.devices] == ["rtx_3090", "gtx_1080_ti", "gtx_1080_ti", "t4"]
    assert not c.calibrated and c.links is not None
    # Capacity for tensors: 24 GiB less the CUDA context, library workspaces and allocator headroom.
    assert 24 * GiB - 2 * GiB < c.devices[0].memory_bytes < 24 * GiB - 700 * 2**20
    assert "uncalibrated" in c.describe()


def test_catalog_unknown_key_suggests():
    with pytest.raises(UnknownNameError, match="did you mean 'rtx_3090'"):
        parse_cluster("catalog:rtx3090")


def test_catalog_rows_are_consistent_specifications():
    """Every row of hetsim/data/gpu_specs.csv obeys what the roofline assumes of it; a row typed wrong
    (a sparse rate taken for a dense one, a GeForce card without its halved accumulate rate) fails here."""
    import csv
    from importlib import resources

    from hetsim.hardware.catalog import load_catalog

    text = resources.files("hetsim").joinpath("data/gpu_specs.csv").read_text()
    assert all(row["source"].strip() for row in csv.DictReader(text.splitlines()))  # every row cites its source
    table = load_catalog()
    assert len(table) >= 56
    for key, e in table.items():
        assert e.mem_gib > 0 and e.mem_bw_gbs > 0 and e.fp32_tflops > 0, key
        assert 0 < e.base_clock_mhz <= e.boost_clock_mhz, key
        major = e.compute_capability[0]
        if major < 7:  # Pascal: no tensor cores
            assert e.fp16_tensor_tflops == e.tf32_tflops == e.bf16_tflops == 0, key
            continue
        assert e.fp16_tensor_tflops >= 1.9 * e.fp32_tflops, key  # tensor cores double the FP32 rate at least
        if major >= 8:  # TF32 and BF16 from Ampere on, TF32 at half the FP16 tensor rate
            assert e.tf32_tflops == pytest.approx(e.fp16_tensor_tflops / 2, rel=0.02), key
            assert e.bf16_tflops == e.fp16_tensor_tflops, key
        else:
            assert e.tf32_tflops == e.bf16_tflops == 0, key
        # GeForce tensor cores accumulate in FP32 at half rate, and the table says so (2); from Ampere on
        # their TF32 rate is then their FP32 rate.
        geforce = e.name.startswith("GeForce")
        assert e.tensor_acc16_ratio == (2.0 if geforce else 1.0), key
        if geforce and major >= 8:
            assert e.tf32_tflops == e.fp32_tflops, key


@pytest.mark.parametrize("spec", ["emu:0@4G", "emu:-1@4G", "emu:1.0@0G", "emu:1.0", "emu:", "emu:x@4G", "bogus"])
def test_bad_specs(spec):
    with pytest.raises(ClusterSpecError):
        parse_cluster(spec)


def test_parse_size():
    assert parse_size("1.5G") == int(1.5 * GiB)
    assert parse_size("1048576") == 2**20  # bytes without a unit


@pytest.mark.parametrize("text", ["1000", "0.5", "17T", "9" * 400 + "T", "inf", "nanG", "1e3G", " ", "4 G B"])
def test_parse_size_refuses_what_no_device_has(text):
    with pytest.raises(ClusterSpecError):
        parse_size(text)


def test_toml_file(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[[device]]\nspeed = 1.0\nmemory = "2G"\n[[device]]\ncatalog = "t4"\n')
    c = parse_cluster(str(f))
    assert c.source == "file" and c.devices[1].kind == "t4"


def test_toml_missing_fields(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('[[device]]\nspeed = 1.0\n')
    with pytest.raises(ClusterSpecError, match="memory"):
        parse_cluster(str(f))


class _FakeNvml:
    """A stand-in for nvidia-ml-py with two GPUs: an RTX 3090 (PCIe4 x16, NVLink) and a T4."""

    def __init__(self):
        self.gpus = [("NVIDIA GeForce RTX 3090", 24 * GiB, (8, 6), 4, 16, True),
                     ("Tesla T4", 15 * GiB, (7, 5), 3, 16, False)]

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.gpus[h][0].encode()

    def nvmlDeviceGetMemoryInfo(self, h):
        return mock.Mock(total=self.gpus[h][1])

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return self.gpus[h][2]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self.gpus[h][3]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self.gpus[h][4]

    def nvmlDeviceGetNvLinkState(self, h, link):
        if not self.gpus[h][5]:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return 1


def test_detect_cuda_with_mocked_nvml():
    with mock.patch.dict("sys.modules", {"pynvml": _FakeNvml()}):
        c = detect_cuda()
    assert c is not None and c.source == "cuda"
    d0, d1 = c.devices
    assert d0.name == "NVIDIA GeForce RTX 3090" and d0.compute_capability == (8, 6)
    assert d0.host_link == "PCIe4 x16" and d0.nvlink and not d1.nvlink
    assert d1.memory_bytes == 15 * GiB and not d1.supports_bf16 and d1.fast_fp16


def test_no_driver_means_no_cuda():
    fake = _FakeNvml()
    fake.nvmlInit = mock.Mock(side_effect=RuntimeError("NVML Shared Library Not Found"))
    with mock.patch.dict("sys.modules", {"pynvml": fake}):
        assert detect_cuda() is None
    with mock.patch.dict("sys.modules", {"pynvml": fake}):
        assert parse_cluster(None).emulated
