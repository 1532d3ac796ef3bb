"""TensorRT engine build from the exported ONNX drafter step (TensorRT 10 Builder API).

NEEDS A TENSORRT HOST: TensorRT is not installable in this workplace, so this path is
written against the documented TensorRT 10 Python API and has only been exercised up to
"tensorrt is missing" here. Steps:

1. load the DSpark plugins: the C++ library ``libdspark_trt_plugin.so`` (built from
   plugins/ with CMake) through ``trt.get_plugin_registry().load_library``, or else the
   Python plugins (``dspark.plugins.trt.qdp.register()``);
2. parse the ONNX file (``trt.OnnxParser``; the DSparkSchedule node maps to the plugin by
   op_type / ``plugin_version`` / ``plugin_namespace``);
3. precision: fp16 or bf16 builder flags (fp32 = none); weights stay as exported;
4. one optimisation profile over R (1 .. max_batch) and T (1 .. max_context) on ``aux``
   and R on the per-request inputs; opt = (max_batch/2, max_context/2);
5. serialise to ``<out>/dspark_draft.plan`` (+ the build log's summary in the manifest).
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path

__all__ = ["TensorRTUnavailable", "TrtBuildError", "tensorrt_version", "find_plugin_library", "build_trt_engine"]

PLUGIN_LIB = "libdspark_trt_plugin.so"


class TensorRTUnavailable(RuntimeError):
    """``import tensorrt`` failed: this host cannot build TensorRT engines."""


class TrtBuildError(RuntimeError):
    pass


def _import_trt():
    try:
        import tensorrt as trt  # noqa: F401
    except ImportError as exc:
        raise TensorRTUnavailable(
            f"TensorRT is not installed here ({exc}); build the 'trt' target on a host with TensorRT 10 "
            "(pip install tensorrt, plus the plugin library from plugins/ via CMake), or drop 'trt' from --what") from None
    return trt


def tensorrt_version() -> str | None:
    try:
        import tensorrt as trt
    except ImportError:
        return None
    return getattr(trt, "__version__", "unknown")


def find_plugin_library(explicit: str | None = None) -> Path | None:
    """$DSPARK_TRT_PLUGIN, an explicit path, or build/ folders of the repository."""
    candidates = [explicit, os.environ.get("DSPARK_TRT_PLUGIN")]
    root = Path(__file__).resolve().parents[2]
    candidates += [str(root / d / PLUGIN_LIB) for d in ("build", "plugins/build", "build/plugins")]
    for c in candidates:
        if c and Path(c).is_file():
            return Path(c)
    return None


def _load_plugins(trt, plugin_lib: str | None) -> str:
    lib = find_plugin_library(plugin_lib)
    if lib is not None:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
        trt.get_plugin_registry().load_library(str(lib))
        return str(lib)
    from dspark.plugins.trt import qdp

    if qdp.available():
        qdp.register()
        return "tensorrt.plugin (dspark.plugins.trt.qdp)"
    raise TrtBuildError(f"no DSpark plugin: build {PLUGIN_LIB} (plugins/CMakeLists.txt) and pass --plugin-lib "
                        "or set DSPARK_TRT_PLUGIN")


def build_trt_engine(onnx_path: str | Path, out_dir: str | Path, *, dtype: str = "float16", max_batch: int = 64,
                     max_context: int = 2048, aux_width: int, plugin_lib: str | None = None,
                     workspace_gib: float = 4.0) -> dict:
    """Build ``<out_dir>/dspark_draft.plan``; raises TensorRTUnavailable without TensorRT."""
    trt = _import_trt()
    logger = trt.Logger(trt.Logger.WARNING)
    trt.init_libnvinfer_plugins(logger, "")
    plugin_source = _load_plugins(trt, plugin_lib)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise TrtBuildError(f"{onnx_path}: ONNX parse failed: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    if dtype == "float16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif dtype == "bfloat16":
        config.set_flag(trt.BuilderFlag.BF16)
    elif dtype != "float32":
        raise TrtBuildError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    profile = builder.create_optimization_profile()
    opt_r, opt_t = max(1, max_batch // 2), max(1, max_context // 2)
    profile.set_shape("aux", (1, 1, aux_width), (opt_r, opt_t, aux_width), (max_batch, max_context, aux_width))
    for name in ("ctx_lens", "anchor", "anchor_pos"):
        profile.set_shape(name, (1,), (opt_r,), (max_batch,))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise TrtBuildError("TensorRT returned no engine (see the log above)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dspark_draft.plan").write_bytes(bytes(plan))
    return {"file": "dspark_draft.plan", "tensorrt": trt.__version__, "dtype": dtype, "plugins": plugin_source,
            "profile": {"R": [1, opt_r, max_batch], "T": [1, opt_t, max_context]}}
