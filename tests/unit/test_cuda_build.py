"""The CUDA kernels and the TensorRT plugin build, as far as this host allows.

- nvcc on PATH: plugins/csrc compiles for sm_90 SASS + compute_90 PTX (torch-free kernel
  library, objects in a tmp dir), and the Philox generator matches the Random123
  known-answer vectors (host build of the same header).
- TensorRT headers (TENSORRT_ROOT or the standard paths): the plugin source compiles, and a
  small host program drives its creators/plugins through the IPluginV3 interfaces.
- cmake: configuring plugins/ without TensorRT says that it builds the kernels only.
- Always: the C++ plugin's names and fields match plugins/contract.py, and every build of the
  kernels takes the scheduler's R*K limit from contract.py (nvcc: the compiled value is
  contract's, a missing or oversized one does not compile).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from dspark.plugins import contract, ops

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "plugins" / "csrc"
TRT = ROOT / "plugins" / "trt"
NVCC = shutil.which("nvcc")
ARCH = ["-gencode", "arch=compute_90,code=sm_90", "-gencode", "arch=compute_90,code=compute_90"]
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH (CI has it): CUDA sources not compiled")
slow = pytest.mark.slow  # compiler runs: ~10-60 s on 2 cores


def _cuda_home() -> Path | None:
    """The CUDA toolkit next to nvcc (which may be a wrapper script), or a standard place."""
    if NVCC is None:
        return None
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                  str(Path(os.path.realpath(NVCC)).parent.parent), "/usr/local/cuda"]
    for c in filter(None, candidates):
        if (Path(c) / "include" / "cuda_runtime_api.h").is_file():
            return Path(c)
    return None


def _trt_include() -> Path | None:
    roots = [os.environ.get("TENSORRT_ROOT", ""), "/usr", "/usr/local/tensorrt", "/opt/tensorrt"]
    for root in filter(None, roots):
        for sub in ("include", "include/x86_64-linux-gnu", "include/aarch64-linux-gnu"):
            if (Path(root) / sub / "NvInferRuntime.h").is_file():
                return Path(root) / sub
    return None


TRT_INCLUDE = _trt_include()
needs_trt = pytest.mark.skipif(TRT_INCLUDE is None, reason="TensorRT headers not found (set TENSORRT_ROOT)")


# --------------------------------------------------------------------------------------
# nvcc: the kernel library
# --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def kernel_objects(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, Path]]:
    """Compile verify.cu and schedule.cu concurrently; {name: (returncode, stderr, object)}."""
    out = tmp_path_factory.mktemp("cuda_objs")
    procs = {}
    for src in ("verify.cu", "schedule.cu"):
        obj = out / (src + ".o")
        cmd = [NVCC, "-std=c++17", "-O3", *ARCH, *contract.kernel_define_flags(), "-I", str(CSRC), "-c",
               str(CSRC / src), "-o", str(obj)]
        procs[src] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), obj)
    result = {}
    for src, (p, obj) in procs.items():
        try:
            _, err = p.communicate(timeout=170)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            err = "timed out\n" + err
        result[src] = (p.returncode, err, obj)
    return result


@slow
@needs_nvcc
@pytest.mark.parametrize("src", ["verify.cu", "schedule.cu"])
def test_kernel_library_compiles_for_sm90_with_ptx(kernel_objects, src: str) -> None:
    rc, err, obj = kernel_objects[src]
    assert rc == 0, f"nvcc failed on {src}:\n{err}"
    assert obj.stat().st_size > 0
    cuobjdump = shutil.which("cuobjdump") or (str(_cuda_home() / "bin" / "cuobjdump") if _cuda_home() else None)
    if cuobjdump and Path(cuobjdump).exists():
        elf = subprocess.run([cuobjdump, "--list-elf", str(obj)], capture_output=True, text=True).stdout
        ptx = subprocess.run([cuobjdump, "--list-ptx", str(obj)], capture_output=True, text=True).stdout
        assert "sm_90" in elf, elf
        assert "sm_90" in ptx or "compute_90" in ptx, ptx


PHILOX_MAIN = r"""
#include <cstdio>
#include "common.cuh"
int main() {
  using dspark::detail::philox4x32_10;
  const unsigned kat[3][6] = {{0u, 0u, 0u, 0u, 0u, 0u},
                              {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu},
                              {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xa4093822u, 0x299f31d0u}};
  for (auto& k : kat) {
    auto r = philox4x32_10(k[0], k[1], k[2], k[3], k[4], k[5]);
    std::printf("%08x %08x %08x %08x\n", r.v[0], r.v[1], r.v[2], r.v[3]);
  }
  double lo = 1.0, hi = 0.0, sum = 0.0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    double u = dspark::detail::uniform53(12345, i / 64, dspark::detail::kStreamAccept, i % 64);
    lo = u < lo ? u : lo; hi = u > hi ? u : hi; sum += u;
  }
  std::printf("%.6f %.6f %.6f\n", lo, hi, sum / n);
  return 0;
}
"""

# Random123's published known-answer vectors for Philox4x32-10.
PHILOX_KAT = ["6627e8d5 e169c58d bc57ac4c 9b00dbd8", "408f276d 41c83b0e a20bc7c6 6d5451fd",
              "d16cfe09 94fdcceb 5001e420 24126ea1"]


@slow
@needs_nvcc
def test_philox_matches_the_known_answer_vectors(tmp_path: Path) -> None:
    src = tmp_path / "philox_kat.cu"
    src.write_text(PHILOX_MAIN)
    exe = tmp_path / "philox_kat"
    build = subprocess.run([NVCC, "-std=c++17", "-I", str(CSRC), str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=170)
    assert build.returncode == 0, build.stderr
    lines = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[:3] == PHILOX_KAT
    lo, hi, mean = map(float, lines[3].split())
    assert 0.0 <= lo < 1e-3 and 1 - 1e-3 < hi < 1.0 and abs(mean - 0.5) < 0.005


# --------------------------------------------------------------------------------------
# TensorRT plugin
# --------------------------------------------------------------------------------------
def _host_compiler_and_cuda() -> tuple[str, Path]:
    """(C++ compiler, CUDA toolkit) for building the TensorRT plugin on the host; skips without them."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    cuda = _cuda_home()
    if cuda is None:
        pytest.skip("CUDA toolkit not found (TensorRT's headers include cuda_runtime_api.h)")
    return cxx, cuda


@slow
@needs_trt
def test_trt_plugin_source_compiles_against_tensorrt_headers() -> None:
    cxx, cuda = _host_compiler_and_cuda()
    cmd = [cxx, "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-deprecated-declarations", f"-I{TRT_INCLUDE}",
           f"-I{cuda / 'include'}", f"-I{CSRC}", f"-I{TRT}", str(TRT / "dspark_plugin.cpp")]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert res.returncode == 0, res.stderr


HARNESS = r"""
// Drives the plugins through the IPluginV3 interfaces; the kernel entry points are stubs
// that record what enqueue passes them.
#include <cstdio>
#include <cstring>
#include <vector>
#include "dspark_plugin.h"
#include "dspark_kernels.h"
using namespace nvinfer1;
namespace dspark {
VerifyParams g_last{};
size_t verify_workspace_bytes(int32_t R, int32_t K, int32_t V) { return size_t(R) * 1000 + K + V; }
cudaError_t verify(const VerifyParams& p, void*, size_t, cudaStream_t) { g_last = p; return cudaSuccess; }
int32_t schedule_max_candidates() { return @SCHEDULE_MAX_CANDIDATES@; }
cudaError_t schedule_prefix(const ScheduleParams&, cudaStream_t) { return cudaSuccess; }
}
extern "C" IPluginCreatorInterface* const* getCreators(int32_t& n);
#define CHECK(c) do { if (!(c)) { std::printf("FAIL %s:%d %s\n", __FILE__, __LINE__, #c); return 1; } } while (0)
static DynamicPluginTensorDesc desc(DataType t, std::vector<int64_t> d) {
  DynamicPluginTensorDesc x{};
  x.desc.type = t; x.desc.format = TensorFormat::kLINEAR; x.desc.dims.nbDims = int32_t(d.size());
  for (size_t i = 0; i < d.size(); ++i) x.desc.dims.d[i] = x.min.d[i] = x.opt.d[i] = x.max.d[i] = d[i];
  x.min.nbDims = x.opt.nbDims = x.max.nbDims = int32_t(d.size());
  return x;
}
int main() {
  int32_t n = 0;
  IPluginCreatorInterface* const* cs = getCreators(n);
  CHECK(n == 2);
  for (int i = 0; i < n; ++i) {
    auto* c = static_cast<IPluginCreatorV3One*>(cs[i]);
    CHECK(std::strcmp(c->getInterfaceInfo().kind, "PLUGIN CREATOR_V3ONE") == 0);
    std::printf("creator %s %s %s", c->getPluginName(), c->getPluginVersion(), c->getPluginNamespace());
    auto const* f = c->getFieldNames();
    for (int j = 0; j < f->nbFields; ++j) std::printf(" %s:%d", f->fields[j].name, int(f->fields[j].type));
    std::printf("\n");
  }
  auto* vc = static_cast<IPluginCreatorV3One*>(cs[0]);
  int32_t K = 7, V = 32000, greedy = 0;
  PluginField fs[3] = {{"block_size", &K, PluginFieldType::kINT32, 1}, {"vocab_size", &V, PluginFieldType::kINT32, 1},
                       {"greedy", &greedy, PluginFieldType::kINT32, 1}};
  PluginFieldCollection fc{3, fs};
  IPluginV3* p = vc->createPlugin("verify", &fc, TensorRTPhase::kBUILD);
  CHECK(p != nullptr);
  auto* core = static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
  auto* build = static_cast<IPluginV3OneBuild*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
  auto* rt = static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
  CHECK(std::strcmp(core->getPluginName(), "DSparkVerify") == 0 && build->getNbOutputs() == 2);
  DataType in_t[7], out_t[2];
  CHECK(build->getOutputDataTypes(out_t, 2, in_t, 7) == 0 && out_t[0] == DataType::kINT64 && out_t[1] == DataType::kINT64);
  const int64_t R = 16;
  std::vector<DynamicPluginTensorDesc> io = {
      desc(DataType::kINT64, {R, K}), desc(DataType::kFLOAT, {R, K, V}), desc(DataType::kBF16, {R, K + 1, V}),
      desc(DataType::kINT64, {R}), desc(DataType::kFLOAT, {R}), desc(DataType::kINT64, {R}),
      desc(DataType::kINT64, {R}), desc(DataType::kINT64, {R}), desc(DataType::kINT64, {R, K + 1})};
  for (int pos = 0; pos < 9; ++pos) CHECK(build->supportsFormatCombination(pos, io.data(), 7, 2));
  io[1].desc.type = DataType::kHALF;  // fp16 draft probs with bf16 logits: not a kernel combination
  CHECK(!build->supportsFormatCombination(2, io.data(), 7, 2));
  io[1].desc.type = DataType::kFLOAT;
  io[0].desc.type = DataType::kINT32;
  CHECK(!build->supportsFormatCombination(0, io.data(), 7, 2));
  io[0].desc.type = DataType::kINT64;
  CHECK(build->configurePlugin(io.data(), 7, io.data() + 7, 2) == 0);
  CHECK(build->getWorkspaceSize(io.data(), 7, io.data() + 7, 2) == size_t(R) * 1000 + K + V);
  io[2].desc.dims.d[2] = V + 1;
  CHECK(build->configurePlugin(io.data(), 7, io.data() + 7, 2) != 0);
  io[2].desc.dims.d[2] = V;
  std::vector<PluginTensorDesc> pd;
  for (auto& d : io) pd.push_back(d.desc);
  CHECK(rt->onShapeChange(pd.data(), 7, pd.data() + 7, 2) == 0);
  char bufs[9][8];
  void const* ins[7];
  void* outs[2];
  for (int i = 0; i < 7; ++i) ins[i] = bufs[i];
  outs[0] = bufs[7]; outs[1] = bufs[8];
  CHECK(rt->enqueue(pd.data(), pd.data() + 7, ins, outs, nullptr, nullptr) == 0);
  auto const& q = dspark::g_last;
  CHECK(q.R == R && q.K == K && q.V == V && !q.all_greedy);
  CHECK(q.draft_tokens == (void const*)bufs[0] && q.draft_probs == bufs[1] && q.target_logits == bufs[2]);
  CHECK(q.verify_lens == (void const*)bufs[3] && q.temperature == (void const*)bufs[4]);
  CHECK(q.seed == (void const*)bufs[5] && q.offset == (void const*)bufs[6]);
  CHECK(q.num_accepted == (void*)bufs[7] && q.output_tokens == (void*)bufs[8]);
  CHECK(q.logits_dtype == dspark::DType::kBFloat16 && q.draft_dtype == dspark::DType::kFloat32);
  // serialize -> runtime plugin with the same fields
  auto const* ser = rt->getFieldsToSerialize();
  CHECK(ser->nbFields == 3);
  IPluginV3* p2 = vc->createPlugin("verify", ser, TensorRTPhase::kRUNTIME);
  CHECK(p2 != nullptr);
  IPluginV3* ctx = static_cast<IPluginV3OneRuntime*>(p2->getCapabilityInterface(PluginCapabilityType::kRUNTIME))
                       ->attachToContext(nullptr);
  CHECK(ctx != nullptr);
  // greedy variant: 3 inputs
  greedy = 1;
  IPluginV3* pg = vc->createPlugin("verify_greedy", &fc, TensorRTPhase::kBUILD);
  auto* bg = static_cast<IPluginV3OneBuild*>(pg->getCapabilityInterface(PluginCapabilityType::kBUILD));
  std::vector<DynamicPluginTensorDesc> gio = {io[0], io[2], io[3], io[7], io[8]};
  for (int pos = 0; pos < 5; ++pos) CHECK(bg->supportsFormatCombination(pos, gio.data(), 3, 2));
  CHECK(bg->configurePlugin(gio.data(), 3, gio.data() + 3, 2) == 0);
  // missing vocab_size -> no plugin
  PluginFieldCollection bad{1, fs};
  CHECK(vc->createPlugin("bad", &bad, TensorRTPhase::kBUILD) == nullptr);
  // scheduler
  auto* sc = static_cast<IPluginCreatorV3One*>(cs[1]);
  std::vector<float> table = {0.f, 1.f, 0.9f, 0.8f};
  PluginField sf[2] = {{"block_size", &K, PluginFieldType::kINT32, 1},
                       {"sps_table", table.data(), PluginFieldType::kFLOAT32, int32_t(table.size())}};
  PluginFieldCollection sfc{2, sf};
  IPluginV3* s = sc->createPlugin("sched", &sfc, TensorRTPhase::kBUILD);
  CHECK(s != nullptr);
  auto* sb = static_cast<IPluginV3OneBuild*>(s->getCapabilityInterface(PluginCapabilityType::kBUILD));
  std::vector<DynamicPluginTensorDesc> sio = {desc(DataType::kFLOAT, {R, K}), desc(DataType::kINT64, {R}),
                                              desc(DataType::kINT64, {R})};
  for (int pos = 0; pos < 3; ++pos) CHECK(sb->supportsFormatCombination(pos, sio.data(), 2, 1));
  CHECK(sb->configurePlugin(sio.data(), 2, sio.data() + 2, 1) == 0);
  sio[0].max.d[0] = 100000;  // R * K over the one-block kernel's capacity
  CHECK(sb->configurePlugin(sio.data(), 2, sio.data() + 2, 1) != 0);
  auto const* sser = static_cast<IPluginV3OneRuntime*>(s->getCapabilityInterface(PluginCapabilityType::kRUNTIME))
                         ->getFieldsToSerialize();
  CHECK(sser->nbFields == 2 && sser->fields[1].length == 4);
  CHECK(sc->createPlugin("sched2", sser, TensorRTPhase::kRUNTIME) != nullptr);
  delete p; delete p2; delete ctx; delete pg; delete s;
  std::printf("OK\n");
  return 0;
}
"""


@slow
@needs_trt
@needs_nvcc
def test_trt_plugin_drives_through_the_iplugin_v3_interfaces(tmp_path: Path) -> None:
    cxx, cuda = _host_compiler_and_cuda()
    (tmp_path / "harness.cpp").write_text(
        HARNESS.replace("@SCHEDULE_MAX_CANDIDATES@", str(contract.SCHEDULE_MAX_CANDIDATES)))
    exe = tmp_path / "harness"
    cmd = [cxx, "-std=c++17", "-Wno-deprecated-declarations", f"-I{TRT_INCLUDE}", f"-I{cuda / 'include'}",
           f"-I{CSRC}", f"-I{TRT}", str(tmp_path / "harness.cpp"), str(TRT / "dspark_plugin.cpp"), "-o", str(exe),
           f"-L{cuda / 'lib64'}", "-lcudart", f"-Wl,-rpath,{cuda / 'lib64'}"]
    build = subprocess.run(cmd, capture_output=True, text=True, timeout=170)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout + run.stderr
    creators = [ln.split() for ln in run.stdout.splitlines() if ln.startswith("creator ")]
    names = {c[1]: c for c in creators}
    assert names[contract.OP_VERIFY][2:4] == [contract.PLUGIN_VERSION, contract.PLUGIN_NAMESPACE]
    assert [f.split(":")[0] for f in names[contract.OP_VERIFY][4:]] == [a.name for a in contract.VERIFY_ATTRS]
    assert [f.split(":")[0] for f in names[contract.OP_SCHEDULE][4:]] == [a.name for a in contract.SCHEDULE_ATTRS]


# --------------------------------------------------------------------------------------
# CMake
# --------------------------------------------------------------------------------------
@slow
@pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake not on PATH")
@needs_nvcc
def test_cmake_configure_without_tensorrt_builds_the_kernels_only(tmp_path: Path) -> None:
    if TRT_INCLUDE is not None and not os.environ.get("TENSORRT_ROOT"):
        pytest.skip("TensorRT is installed in a standard path: the 'not found' branch cannot be exercised")
    env = {k: v for k, v in os.environ.items() if k != "TENSORRT_ROOT"}
    empty = tmp_path / "no_tensorrt"
    empty.mkdir()
    res = subprocess.run(["cmake", "-S", str(ROOT / "plugins"), "-B", str(tmp_path / "build"),
                          f"-DTENSORRT_ROOT={empty}", f"-DCMAKE_CUDA_COMPILER={NVCC}"],
                         capture_output=True, text=True, env=env, timeout=170)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "DSpark: TensorRT not found" in res.stdout and "Building the kernel library only" in res.stdout
    assert f"scheduler takes R*K <= {contract.SCHEDULE_MAX_CANDIDATES} (plugins/contract.py)" in res.stdout, res.stdout


LIMIT_MAIN = r"""
#include <cstdio>
#include "dspark_kernels.h"
int main() { std::printf("%d\n", dspark::schedule_max_candidates()); return 0; }
"""


@slow
@needs_nvcc
def test_compiled_scheduler_limit_is_the_contracts(kernel_objects, tmp_path: Path) -> None:
    rc, err, obj = kernel_objects["schedule.cu"]
    assert rc == 0, err
    (tmp_path / "limit.cpp").write_text(LIMIT_MAIN)
    exe = tmp_path / "limit"
    build = subprocess.run([NVCC, "-std=c++17", "-I", str(CSRC), str(tmp_path / "limit.cpp"), str(obj), "-o", str(exe)],
                           capture_output=True, text=True, timeout=170)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) == contract.SCHEDULE_MAX_CANDIDATES, "schedule.cu must be built with contract.py's limit"


@slow
@needs_nvcc
def test_scheduler_header_refuses_a_missing_or_oversized_limit(tmp_path: Path) -> None:
    src = tmp_path / "probe.cu"
    src.write_text('#include "schedule.cuh"\nint main() { return dspark::detail::kScheduleMaxCandidates > 0 ? 0 : 1; }\n')

    def compile_with(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([NVCC, "-std=c++17", *ARCH, *flags, "-I", str(CSRC), "-c", str(src),
                               "-o", str(tmp_path / "probe.o")], capture_output=True, text=True, timeout=170)

    missing = compile_with()
    assert missing.returncode != 0 and "DSPARK_SCHEDULE_MAX_CANDIDATES is not defined" in missing.stderr, missing.stderr
    too_big = compile_with(f"-DDSPARK_SCHEDULE_MAX_CANDIDATES={2 ** 30}")  # past any one-block launch
    assert too_big.returncode != 0 and "must fit one block" in too_big.stderr, too_big.stderr


# --------------------------------------------------------------------------------------
# Contract vs sources (always)
# --------------------------------------------------------------------------------------
def _cpp_const(text: str, name: str) -> str:
    m = re.search(rf'{name}\s*=\s*"([^"]*)"', text)
    assert m, name
    return m.group(1)


def test_plugin_constants_match_the_contract() -> None:
    header = (TRT / "dspark_plugin.h").read_text()
    assert _cpp_const(header, "kVerifyName") == contract.OP_VERIFY == contract.OP_TYPE
    assert _cpp_const(header, "kScheduleName") == contract.OP_SCHEDULE
    assert _cpp_const(header, "kPluginVersion") == contract.PLUGIN_VERSION
    assert _cpp_const(header, "kPluginNamespace") == contract.PLUGIN_NAMESPACE


def test_creator_fields_match_the_contract() -> None:
    src = (TRT / "dspark_plugin.cpp").read_text()

    def creator_fields(cls: str) -> list[tuple[str, str]]:
        body = src[src.index(f"{cls}::{cls}()"):]
        body = body[: body.index("}")]
        return re.findall(r'emplace_back\("(\w+)", nullptr, PluginFieldType::(\w+)', body)

    assert creator_fields("DSparkVerifyCreator") == [(a.name, a.trt_field_type) for a in contract.VERIFY_ATTRS]
    assert creator_fields("DSparkScheduleCreator") == [(a.name, a.trt_field_type) for a in contract.SCHEDULE_ATTRS]
    header = (TRT / "dspark_plugin.h").read_text()
    assert "mGreedy ? 3 : 7" in header
    assert len(contract.VERIFY_INPUTS_GREEDY) == 3 and len(contract.VERIFY_INPUTS) == 7


def test_contract_node_builders() -> None:
    node = contract.verify_node(7, 151936, greedy=False)
    assert node["op_type"] == "DSparkVerify"
    assert node["attributes"] == {"plugin_version": "1", "plugin_namespace": "dspark", "block_size": 7,
                                  "vocab_size": 151936, "greedy": 0}
    assert node["inputs"] == ["draft_tokens", "draft_probs", "target_logits", "verify_lens", "temperature", "seed",
                              "offset"]
    assert node["outputs"] == ["num_accepted", "output_tokens"]
    assert contract.verify_node(7, 100, greedy=True)["inputs"] == ["draft_tokens", "target_logits", "verify_lens"]
    sched = contract.schedule_node(7, [0.0, 1.0, 0.5], with_max_lens=True)
    assert sched["inputs"] == ["confidence", "max_lens"] and sched["attributes"]["sps_table"] == [0.0, 1.0, 0.5]
    assert contract.schedule_node(7, [0.0, 1.0])["inputs"] == ["confidence"]
    with pytest.raises(ValueError):
        contract.schedule_attributes(7, [1.0])
    assert contract.SCHEDULE_MAX_CANDIDATES == ops.SCHEDULE_MAX_CANDIDATES


def _packaged(path: Path) -> bool:
    """Whether setuptools ships ``path``, read from pyproject: a .py file of a listed package, or
    a package-data glob of the listed package whose folder holds it (package-dir maps the
    top folders; subpackages live in subfolders of their parent)."""
    import fnmatch
    import tomllib

    st = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    roots = st["package-dir"]

    def folder(pkg: str) -> Path:
        head = max((p for p in roots if pkg == p or pkg.startswith(p + ".")), key=len)
        return ROOT / roots[head] / Path(*pkg[len(head):].split(".")[1:])

    for pkg in st["packages"]:
        d = folder(pkg)
        if path.parent == d and path.suffix == ".py":
            return True
        if d in path.parents:
            rel = path.relative_to(d).as_posix()
            if any(fnmatch.fnmatch(rel, g) and rel.count("/") == g.count("/") for g in st["package-data"].get(pkg, [])):
                return True
    return False


def test_extension_sources_exist_and_are_packaged() -> None:
    for name in ops.SOURCES:
        assert (CSRC / name).is_file(), name
    shipped = [*(ROOT / "plugins" / "csrc").iterdir(), *(ROOT / "plugins" / "trt").iterdir(),
               ROOT / "plugins" / "CMakeLists.txt", *(ROOT / "configs").glob("*/*.yaml")]
    for f in shipped:
        if f.is_file() and f.suffix != ".pyc":
            assert _packaged(f), f"{f.relative_to(ROOT)} is not in the wheel: pyproject's packages/package-data miss it"



def test_scheduler_limit_has_one_source_the_contract() -> None:
    """contract.py holds the R*K limit; the kernel, the op and CMake take it from there."""
    assert ops.SCHEDULE_MAX_CANDIDATES is contract.SCHEDULE_MAX_CANDIDATES
    assert contract.kernel_define_flags() == [f"-DDSPARK_SCHEDULE_MAX_CANDIDATES={contract.SCHEDULE_MAX_CANDIDATES}"]
    header = (CSRC / "schedule.cuh").read_text()
    assert "kScheduleMaxCandidates = DSPARK_SCHEDULE_MAX_CANDIDATES;" in header
    literal = str(contract.SCHEDULE_MAX_CANDIDATES)
    for f in [*CSRC.iterdir(), *TRT.iterdir(), ROOT / "plugins" / "ops.py"]:
        if f.is_file() and f.suffix != ".pyc":
            assert literal not in f.read_text(), f"{f.relative_to(ROOT)} repeats the limit; take it from contract.py"
    # the line CMakeLists.txt parses (same regex, Python syntax) gives contract's value
    cmake = (ROOT / "plugins" / "CMakeLists.txt").read_text()
    pattern = re.search(r'contract\.py" DSPARK_LIMIT_LINE REGEX "([^"]+)"', cmake).group(1)
    lines = [ln for ln in (ROOT / "plugins" / "contract.py").read_text().splitlines() if re.fullmatch(pattern, ln)]
    assert len(lines) == 1 and int(lines[0].split("=")[1]) == contract.SCHEDULE_MAX_CANDIDATES, lines


def test_tensorrt_python_plugins_are_optional() -> None:
    from dspark.plugins.trt import qdp

    if qdp.available():
        pytest.skip("tensorrt.plugin is installed here")
    with pytest.raises(RuntimeError, match="tensorrt.plugin is not importable"):
        qdp.register()
