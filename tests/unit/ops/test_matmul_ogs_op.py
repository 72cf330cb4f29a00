"""matmul_ogs op: codecs for its opaque arguments, schema and domains, contracts, reference glue (CPU only).

Calls are built the way vLLM 0.25.1 prepares gpt-oss on Hopper (checkpoint MXFP4 tensors transposed and swizzled
with the HOPPER_VALUE / HOPPER_SCALE layouts, routing like triton_kernels' ``routing_torch``), as moereplay's plain
specs — triton_kernels itself is only importable on the GPU machine (tests/gpu/test_replay_ogs.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from moereplay.errors import InvalidMutationError, UnsupportedValueError
from moereplay.format import CaptureReader, CaptureWriter
from moereplay.ops import get_op
from moereplay.ops import ogs_codecs as codecs
from moereplay.ops.base import OpSpec, argument_names, mutable_arg
from moereplay.ops.matmul_ogs import (
    OP,
    contract_args,
    plain_args,
    predicted_block_k,
    predicted_block_m,
    problem_of,
    relayout_scales,
    scale_bytes_read,
)
from moereplay.ops.ogs_codecs import (
    ActivationSpec,
    EpilogueSpec,
    ExptDataSpec,
    FlexCtxSpec,
    FlexDataSpec,
    FnSpec,
    GatherSpec,
    LayoutSpec,
    LayoutTensor,
    PrecisionSpec,
    RoutingSpec,
    ScatterSpec,
)
from moereplay.reference.hopper_mxfp4 import swizzle_hopper_scales, swizzle_hopper_values

SWIGLU = FnSpec("swiglu", "triton_kernels.swiglu_details._swiglu", "_swiglu_fn", ("alpha", "limit"))

# ---------------------------------------------------------------------------------------------------------------
# building gpt-oss-like calls as plain specs
# ---------------------------------------------------------------------------------------------------------------


def mxfp4_weight(
    experts: int, k: int, n: int, seed: int, num_warps: int = 8
) -> tuple[LayoutTensor, LayoutTensor]:
    """Checkpoint ``[E, N, K/2]`` codes and ``[E, N, K/32]`` scales, prepared like ``_swizzle_mxfp4`` on sm_90."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (experts, n, k // 2), generator=g).to(torch.uint8)
    scales = torch.randint(118, 126, (experts, n, k // 32), generator=g).to(torch.uint8)
    values_t, scales_t = packed.transpose(1, 2), scales.transpose(1, 2)  # [E, K/2, N], [E, K/32, N]
    w = LayoutTensor(
        swizzle_hopper_values(values_t, 1),
        LayoutSpec("HOPPER_VALUE", tuple(values_t.shape), mx_axis=1, mma_version=3),
        "fp4",
        (experts, k, n),
        (experts, k, n),
    )
    s = LayoutTensor(
        swizzle_hopper_scales(scales_t, 1, num_warps),
        LayoutSpec("HOPPER_SCALE", tuple(scales_t.shape), mx_axis=1, num_warps=num_warps),
        "uint8",
        tuple(scales_t.shape),
        tuple(scales_t.shape),
    )
    return w, s


def routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[RoutingSpec, GatherSpec, ScatterSpec]:
    """triton_kernels ``routing_torch`` semantics, with the per-block tile maps of ``compute_expt_data_torch``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack(
        [torch.sort(torch.randperm(experts, generator=g)[:top_k]).values for _ in range(tokens)]
    )
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=1).to(torch.bfloat16)
    flat = ids.reshape(-1).to(torch.int32)
    topk_indx = torch.argsort(flat, stable=True).to(torch.int32)
    gate_indx = torch.argsort(topk_indx, stable=True).to(torch.int32)
    gate_scal = weights.reshape(-1)[topk_indx.long()]
    hist = torch.bincount(flat, minlength=experts).to(torch.int32)
    offs = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(hist, 0).to(torch.int32)])
    gates = flat.numel()
    max_tiles = gates if gates <= experts else experts - 1 - ((experts - gates - 1) // 16)
    pads: dict[int, torch.Tensor] = {}
    maps: dict[int, torch.Tensor] = {}
    for block in (16, 32, 64, 128):
        tiles = (hist + block - 1) // block
        pads[block] = torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(tiles, 0).to(torch.int32)])
        tile_map = torch.full((max_tiles,), -1, dtype=torch.int32)
        for e in range(experts):
            for b in range(int(tiles[e])):
                tile_map[int(pads[block][e]) + b] = (b << 16) + e
        maps[block] = tile_map
    spec = RoutingSpec(gate_scal, hist, experts, top_k, ExptDataSpec(hist, offs, pads, maps))
    return spec, GatherSpec(topk_indx, gate_indx), ScatterSpec(gate_indx, topk_indx)


def gemm1_args(
    tokens: int = 6, experts: int = 4, top_k: int = 2, k: int = 2880, n: int = 512
) -> dict[str, Any]:
    """w13: gather, fp32 bias, fused swiglu, y of [1, tokens·top_k, n/2]; opt_flags as vLLM pins them (split_k=1)."""
    w, scale = mxfp4_weight(experts, k, n, seed=1)
    route, gather, _ = routing(tokens, experts, top_k, seed=2)
    g = torch.Generator().manual_seed(3)
    return {
        "x": torch.randn(tokens, k, generator=g).to(torch.bfloat16),
        "w": w,
        "bias": torch.randn(experts, n, generator=g),
        "routing_data": route,
        "gather_indx": gather,
        "scatter_indx": None,
        "precision_config": PrecisionSpec(weight_scale=scale),
        "betas": None,
        "gammas": None,
        "out_alpha": None,
        "y": torch.zeros(1, tokens * top_k, n // 2, dtype=torch.bfloat16),
        "fused_activation": ActivationSpec(SWIGLU, (1.702, 7.0), 2),
        "epilogue": None,
        "split_k": 1,
    }


def gemm2_args(
    tokens: int = 6, experts: int = 4, top_k: int = 2, k: int = 2880, n: int = 256
) -> dict[str, Any]:
    """w2: scatter (grouped top-k sum), fp32 bias, gammas = the routing weights, y of [1, tokens, n]."""
    w, scale = mxfp4_weight(experts, k, n, seed=4)
    route, _, scatter = routing(tokens, experts, top_k, seed=2)
    g = torch.Generator().manual_seed(5)
    return {
        "x": torch.randn(tokens * top_k, k, generator=g).to(torch.bfloat16),
        "w": w,
        "bias": torch.randn(experts, n, generator=g),
        "routing_data": route,
        "gather_indx": None,
        "scatter_indx": scatter,
        "precision_config": PrecisionSpec(weight_scale=scale),
        "betas": None,
        "gammas": route.gate_scal,
        "out_alpha": None,
        "y": torch.zeros(1, tokens, n, dtype=torch.bfloat16),
        "fused_activation": None,
        "epilogue": None,
        "split_k": 1,
    }


def walk(tree: Any) -> list[Any]:
    """Every leaf of a value tree."""
    if isinstance(tree, dict):
        return [leaf for key, value in tree.items() for leaf in [key, *walk(value)]]
    if isinstance(tree, (list, tuple)):
        return [leaf for value in tree for leaf in walk(value)]
    return [tree]


def same_tensors(a: Any, b: Any) -> None:
    """Two plain specs hold the very same tensor objects at the same paths (no copies) and equal other fields."""
    left, right = codecs.tensor_leaves(a, "v"), codecs.tensor_leaves(b, "v")
    assert left.keys() == right.keys()
    for path in left:
        assert left[path] is right[path], path
    assert codecs.replace_tensor_leaves(a, "v", {p: None for p in left}) == codecs.replace_tensor_leaves(
        b, "v", {p: None for p in right}
    )


# ---------------------------------------------------------------------------------------------------------------
# codecs
# ---------------------------------------------------------------------------------------------------------------


def test_every_opaque_value_round_trips_through_its_tree_sharing_tensors() -> None:
    args = gemm1_args()
    scatter = routing(6, 4, 2, seed=2)[2]
    flex = FlexCtxSpec(
        lhs_data=FlexDataSpec("in", None, scale=torch.ones(1)),
        rhs_data=FlexDataSpec("in", "float8_e4m3fn", scale=torch.full((4,), 2.0)),
        out_data=FlexDataSpec("out", None, expected_scale=torch.ones(1), actual_scale=torch.zeros(1)),
    )
    precision = dataclasses.replace(
        args["precision_config"], flex_ctx=flex, out_dtype="float32", allow_tf32=False
    )
    epilogue = EpilogueSpec(
        FnSpec("q", "triton_kernels.numerics_details.mxfp", "quantize", ("a",)), (1.5,), (), 2.0
    )
    cases = [
        (codecs.WEIGHT, args["w"]),
        (codecs.WEIGHT, torch.zeros(4, 8, 16, dtype=torch.bfloat16)),
        (codecs.LAYOUT_TENSOR, args["precision_config"].weight_scale),
        (codecs.ROUTING, args["routing_data"]),
        (codecs.ROUTING, RoutingSpec(None, torch.ones(4, dtype=torch.int32), 4, 1)),
        (codecs.GATHER, args["gather_indx"]),
        (codecs.SCATTER, scatter),
        (codecs.PRECISION, precision),
        (codecs.PRECISION, PrecisionSpec()),
        (codecs.ACTIVATION, args["fused_activation"]),
        (codecs.ACTIVATION, ActivationSpec()),
        (codecs.EPILOGUE, epilogue),
    ]
    for codec, value in cases:
        tree = codec.encode(value)
        for leaf in walk(tree):
            assert leaf is None or isinstance(leaf, (bool, int, float, str, torch.Tensor)), (codec.name, leaf)
        decoded = codec.decode(tree, backend=None)
        if isinstance(value, torch.Tensor):
            assert decoded is value
        else:
            assert type(decoded) is type(value)
            same_tensors(decoded, value)
        assert codec.decode(value, backend=None) is value  # already plain: unchanged


def test_layout_tensor_keeps_the_swizzled_storage_view_itself() -> None:
    w, scale = mxfp4_weight(2, 2880, 512, seed=7)
    for value in (w, scale):
        tree = codecs.encode_layout_tensor(value)
        assert tree["storage"] is value.storage  # the bytes the kernel reads, not an unswizzled copy
        assert tree["storage"].stride(-2) == 1  # mx_axis=1: a transposed view of a contiguous block
    assert scale.storage.shape == (2, 2880, 512 // 32)  # [E, 32·K/32, N_pad/32]
    assert codecs.encode_layout(scale.layout) == {
        "kind": "HOPPER_SCALE",
        "initial_shape": [2, 90, 512],
        "mx_axis": 1,
        "num_warps": 8,
        "mma_version": None,
    }


def test_codecs_round_trip_through_a_capture_file(tmp_path: Any) -> None:
    args = gemm2_args(tokens=3, experts=2, k=128, n=64)
    path = tmp_path / "ogs.moe.zst"
    with CaptureWriter(path) as writer:
        writer.begin_call("matmul_ogs", args, static={"w", "precision_config"})
    with CaptureReader(path) as reader:
        loaded = reader.load_args(0)
    assert isinstance(loaded["w"], LayoutTensor)
    assert isinstance(loaded["routing_data"], RoutingSpec)
    assert isinstance(loaded["scatter_indx"], ScatterSpec)
    assert isinstance(loaded["precision_config"], PrecisionSpec)
    assert loaded["w"].layout == args["w"].layout
    assert loaded["w"].storage.stride() == args["w"].storage.stride()
    assert torch.equal(loaded["w"].storage, args["w"].storage)
    scale, original = loaded["precision_config"].weight_scale, args["precision_config"].weight_scale
    assert scale.layout == original.layout and torch.equal(scale.storage, original.storage)
    assert loaded["routing_data"].expt_data.block_sizes == (16, 32, 64, 128)
    for block in (16, 128):
        assert torch.equal(
            loaded["routing_data"].expt_data.block_pid_map[block],
            args["routing_data"].expt_data.block_pid_map[block],
        )
    assert torch.equal(loaded["gammas"], args["gammas"])
    assert loaded["split_k"] == 1 and loaded["fused_activation"] is None
    # the reference gives the same answer from the loaded call
    assert torch.equal(OP.reference(loaded).output, OP.reference(args).output)


def test_malformed_or_hostile_trees_are_refused_with_one_line() -> None:
    good = codecs.encode_activation(ActivationSpec(SWIGLU, (1.702, 7.0), 2))
    hostile = {**good, "specs": {**good["specs"], "fn_module": "os", "fn_name": "system"}}
    with pytest.raises(UnsupportedValueError, match="outside triton_kernels"):
        codecs.ACTIVATION.decode(hostile, backend=None)
    tree = codecs.encode_layout_tensor(mxfp4_weight(1, 128, 256, seed=1)[1])
    with pytest.raises(UnsupportedValueError, match="malformed"):
        codecs.LAYOUT_TENSOR.decode({**tree, "layout": {**tree["layout"], "kind": "EVIL"}}, backend=None)
    with pytest.raises(UnsupportedValueError, match="not a torch dtype"):
        codecs.LAYOUT_TENSOR.decode({**tree, "dtype": "__class__"}, backend=None)
    with pytest.raises(UnsupportedValueError, match="lacks 'n_expts_act'"):
        codecs.ROUTING.decode({"n_expts_tot": 4}, backend=None)
    with pytest.raises(UnsupportedValueError, match="not a mapping"):
        codecs.PRECISION.decode([1, 2], backend=None)
    with pytest.raises(UnsupportedValueError, match="pair"):
        codecs.ROUTING.decode(
            {"n_expts_tot": 4, "n_expts_act": 1, "expt_data": {"block_pid_map": [[16, "x"]]}}, backend=None
        )
    with pytest.raises(UnsupportedValueError, match="malformed"):
        codecs.ROUTING.decode({"n_expts_tot": "four", "n_expts_act": 1}, backend=None)
    with pytest.raises(UnsupportedValueError):
        codecs.ROUTING.encode(object())


# stand-ins for the library's *data* classes (same names, modules and fields as vLLM 0.25.1's triton_kernels), so
# the library side of the codecs runs on a CPU machine; the GPU test uses the real classes.


def _library_namespace() -> codecs.TritonKernels:
    import types

    def cls(module: str, name: str, fields: list[tuple[str, Any]], frozen: bool = False) -> type:
        made = dataclasses.make_dataclass(
            name, [(f, Any, dataclasses.field(default=d)) for f, d in fields], frozen=frozen
        )
        made.__module__ = f"triton_kernels.{module}"
        return made

    class StridedLayout:
        name = None

        def __init__(self, shape: Any) -> None:
            self.initial_shape = shape

    class HopperMXScaleLayout:
        name = "HOPPER_SCALE"

        def __init__(self, shape: Any, mx_axis: int, num_warps: int = 8) -> None:
            self.initial_shape, self.mx_axis, self.num_warps = shape, mx_axis, num_warps

    class HopperMXValueLayout:
        name = "HOPPER_VALUE"

        def __init__(self, shape: Any, mx_axis: int, mma_version: int = 3) -> None:
            self.initial_shape, self.mx_axis, self.mma_version = shape, mx_axis, mma_version

    for layout in (StridedLayout, HopperMXScaleLayout, HopperMXValueLayout):
        layout.__module__ = "triton_kernels.tensor_details.layout_details.x"
    float_type = cls(
        "tensor", "FloatType", [("bitwidth_exponent", 0), ("bitwidth_mantissa", 0), ("is_signed", 0)]
    )
    fn_specs = cls(
        "matmul_ogs",
        "FnSpecs",
        [("name", None), ("fn", None), ("fn_arg_names", ()), ("fn_arg_do_not_specialize", ())],
        frozen=True,
    )
    fn_specs.default = staticmethod(lambda: fn_specs("dflt", None, ()))  # type: ignore[attr-defined]
    swiglu_fn = types.SimpleNamespace(
        fn=types.SimpleNamespace(__module__=SWIGLU.fn_module, __name__=SWIGLU.fn_name)
    )
    modules = {
        "triton_kernels.tensor": types.SimpleNamespace(
            Storage=cls("tensor", "Storage", [("data", None), ("layout", None)]),
            Tensor=cls(
                "tensor", "Tensor", [("storage", None), ("dtype", None), ("shape", None), ("shape_max", None)]
            ),
            FP4=float_type(2, 1, True),
            BIT=None,
        ),
        "triton_kernels.tensor_details.layout": types.SimpleNamespace(
            StridedLayout=StridedLayout,
            HopperMXScaleLayout=HopperMXScaleLayout,
            HopperMXValueLayout=HopperMXValueLayout,
        ),
        "triton_kernels.routing": types.SimpleNamespace(
            RoutingData=cls(
                "routing",
                "RoutingData",
                [
                    ("gate_scal", None),
                    ("expt_hist", None),
                    ("n_expts_tot", 0),
                    ("n_expts_act", 0),
                    ("expt_data", None),
                    ("expected_tokens_per_expt", None),
                ],
            ),
            ExptData=cls(
                "routing",
                "ExptData",
                [("hist", None), ("token_offs_raw", None), ("token_offs_pad", None), ("block_pid_map", None)],
            ),
            GatherIndx=cls("routing", "GatherIndx", [("src_indx", None), ("dst_indx", None)]),
            ScatterIndx=cls("routing", "ScatterIndx", [("src_indx", None), ("dst_indx", None)]),
        ),
        "triton_kernels.numerics": types.SimpleNamespace(
            InFlexData=cls("numerics", "InFlexData", [("dtype", None), ("scale", None)], frozen=True),
            OutFlexData=cls(
                "numerics",
                "OutFlexData",
                [("dtype", None), ("expected_scale", None), ("actual_scale", None), ("checksum_scale", None)],
                frozen=True,
            ),
        ),
        "triton_kernels.matmul_ogs": types.SimpleNamespace(
            FnSpecs=fn_specs,
            FlexCtx=cls(
                "matmul_ogs", "FlexCtx", [("lhs_data", None), ("rhs_data", None), ("out_data", None)]
            ),
            PrecisionConfig=cls(
                "matmul_ogs",
                "PrecisionConfig",
                [
                    (f, d)
                    for f, d in (
                        ("max_num_imprecise_acc", None),
                        ("allow_tf32", True),
                        ("flex_ctx", None),
                        ("acc_scale", 1.0),
                        ("flexpoint_saturate_inf", False),
                        ("report_quantization_err_fn", None),
                        ("act_scale", None),
                        ("weight_scale", None),
                        ("out_scale", None),
                        ("out_dtype", None),
                        ("enforce_bitwise_invariance", False),
                    )
                ],
            ),
            FusedActivation=cls(
                "matmul_ogs", "FusedActivation", [("specs", None), ("fn_args", ()), ("reduction_n", 1)]
            ),
            Epilogue=cls(
                "matmul_ogs",
                "Epilogue",
                [
                    ("specs", None),
                    ("fn_arg_values_matmul", ()),
                    ("fn_arg_values_finalize", ()),
                    ("effective_itemsize", None),
                ],
            ),
        ),
        "triton_kernels.swiglu_details._swiglu": types.SimpleNamespace(_swiglu_fn=swiglu_fn),
    }
    return codecs.TritonKernels(lambda name: modules[name])  # type: ignore[arg-type, return-value]


def test_library_objects_built_from_specs_encode_back_to_the_same_specs() -> None:
    library = _library_namespace()
    args = gemm1_args(k=128, n=256)
    scatter = routing(6, 4, 2, seed=2)[2]
    built = OP.library_args({**args, "scatter_indx": scatter}, library)
    assert type(built["w"]).__name__ == "Tensor" and built["w"].storage.data is args["w"].storage
    assert built["w"].storage.layout.mx_axis == 1 and built["w"].dtype.bitwidth_exponent == 2
    assert built["precision_config"].weight_scale.storage.layout.num_warps == 8
    assert (
        built["routing_data"].expt_data.block_pid_map[64] is args["routing_data"].expt_data.block_pid_map[64]
    )
    assert built["fused_activation"].specs.fn.fn.__name__ == "_swiglu_fn"
    assert "split_k" not in built  # process state is applied as opt_flags constraints, not passed
    back = plain_args(built)
    for name in ("w", "routing_data", "gather_indx", "precision_config", "fused_activation"):
        same_tensors(back[name], args[name])
    same_tensors(back["scatter_indx"], scatter)


def test_a_python_callback_in_the_precision_config_is_refused() -> None:
    library = _library_namespace()
    config = library.module("matmul_ogs").PrecisionConfig(report_quantization_err_fn=print)
    with pytest.raises(UnsupportedValueError, match="callable"):
        codecs.PRECISION.encode(config)


def test_codecs_are_registered_with_the_format_under_both_import_paths() -> None:
    from moereplay.format.codecs import codec_for

    for name in ("RoutingData", "GatherIndx", "ScatterIndx"):
        for prefix in ("triton_kernels.routing", "vllm.third_party.triton_kernels.routing"):
            assert codec_for(f"{prefix}.{name}") is not None
    assert codec_for("triton_kernels.tensor.Tensor") is not None
    assert codec_for("vllm.third_party.triton_kernels.matmul_ogs.PrecisionConfig") is not None


# ---------------------------------------------------------------------------------------------------------------
# schema and domains
# ---------------------------------------------------------------------------------------------------------------


def test_schema_follows_matmul_ogs_then_the_process_state() -> None:
    op = get_op("matmul_ogs")
    assert isinstance(op, OpSpec)
    assert argument_names(op)[:13] == (
        "x", "w", "bias", "routing_data", "gather_indx", "scatter_indx", "precision_config",
        "betas", "gammas", "out_alpha", "y", "fused_activation", "epilogue",
    )  # fmt: skip
    assert set(argument_names(op)[13:]) == {
        "block_m", "block_k", "split_k", "num_stages", "fused_scatter", "is_persistent", "epilogue_subtile",
        "idle_sms", "num_warps",
    }  # fmt: skip
    assert all(spec.codec is not None for spec in op.arguments if spec.kind.value == "opaque")
    assert op.output_name == "y" and op.scratch == ("y",)


@pytest.mark.parametrize(
    ("name", "value", "args_kind", "reason"),
    [
        ("block_m", 16, "gemm1", None),
        ("block_m", 128, "gemm2", None),
        ("block_m", 48, "gemm1", "not one of"),
        ("block_m", 256, "gemm1", "not one of"),
        ("block_k", 64, "gemm1", None),
        ("block_k", 256, "gemm2", None),
        ("block_k", 32, "gemm1", "multiple of 64"),
        ("split_k", 1, "gemm1", None),
        ("split_k", 4, "gemm2", None),
        ("split_k", 0, "gemm1", "< 1"),
        ("fused_scatter", False, "gemm2", None),
        ("fused_scatter", True, "gemm2", "n_expts_act == 1"),
        ("fused_scatter", True, "gemm1", "needs a scatter"),
        ("is_persistent", False, "gemm1", None),
        ("is_persistent", True, "gemm1", "cannot use TMA"),
        ("num_warps", 4, "gemm1", None),
        ("num_warps", 16, "gemm1", "not one of"),
        ("num_stages", 3, "gemm1", None),
        ("num_stages", 0, "gemm1", "< 1"),
    ],
)
def test_mutation_domains(name: str, value: Any, args_kind: str, reason: str | None) -> None:
    args = gemm1_args(k=128) if args_kind == "gemm1" else gemm2_args(k=128)
    mutable = mutable_arg(OP, name)
    assert mutable is not None
    verdict = mutable.domain.check(value, args)
    if reason is None:
        assert verdict is None
    else:
        assert verdict is not None and reason in verdict, verdict


def test_block_m_must_have_a_tile_map_in_the_routing_and_fused_scatter_can_be_legal() -> None:
    args = gemm2_args(k=128, top_k=1)
    data = args["routing_data"].expt_data
    only_16 = dataclasses.replace(data, block_pid_map={16: data.block_pid_map[16]})
    args["routing_data"] = dataclasses.replace(args["routing_data"], expt_data=only_16)
    assert mutable_arg(OP, "block_m").domain.check(16, args) is None
    assert "no tile map" in mutable_arg(OP, "block_m").domain.check(32, args)
    assert mutable_arg(OP, "fused_scatter").domain.check(True, args) is None
    assert "split_k" in mutable_arg(OP, "split_k").domain.check(2, {**args, "fused_scatter": True})
    assert mutable_arg(OP, "block_k").domain.candidates(args) == (64, 128, 256)


def test_num_warps_is_only_mutable_over_hopper_scales_and_parses_cli_text() -> None:
    args = gemm1_args(k=128)
    args["precision_config"] = dataclasses.replace(
        args["precision_config"], weight_scale=torch.zeros(4, 4, 512)
    )
    assert "fixed by the weight-scale layout" in mutable_arg(OP, "num_warps").domain.check(4, args)
    assert mutable_arg(OP, "block_k").domain.parse("0x80") == 128
    with pytest.raises(InvalidMutationError):
        mutable_arg(OP, "fused_scatter").domain.parse("maybe")


def test_rederiving_num_warps_reswizzles_the_scales_and_back() -> None:
    args = gemm1_args(k=2880, n=512)
    original = args["precision_config"]
    four = OP.rederive({**args, "num_warps": 4}, frozenset({"num_warps"}))["precision_config"]
    scale4 = four.weight_scale
    assert scale4.layout.num_warps == 4 and scale4.storage.shape == (4, 2880, 512 // 32)
    assert not torch.equal(scale4.storage, original.weight_scale.storage)  # a different byte order
    back = relayout_scales(four, 8).weight_scale
    assert torch.equal(back.storage, original.weight_scale.storage)
    assert back.storage.stride() == original.weight_scale.storage.stride()
    assert OP.rederive(args, frozenset({"block_k"})) == args  # nothing derived from block_k


def test_make_scratch_gives_a_fresh_zeroed_output() -> None:
    args = gemm2_args(k=128)
    args["y"].fill_(7)
    scratch = OP.make_scratch(args, torch.device("cpu"))
    assert scratch["y"] is not args["y"] and scratch["y"].shape == args["y"].shape
    assert scratch["y"].dtype == torch.bfloat16 and not scratch["y"].any()
    assert OP.make_scratch({**args, "y": None}, torch.device("cpu")) == {"y": None}


# ---------------------------------------------------------------------------------------------------------------
# contracts
# ---------------------------------------------------------------------------------------------------------------


def test_predicted_flags_follow_the_nvidia_heuristics() -> None:
    args = gemm1_args(tokens=40, experts=4, top_k=2, k=2880)
    assert problem_of(args).rows == 80 and problem_of(args).k == 2880 and problem_of(args).reduction_n == 2
    assert predicted_block_m(args) == 32  # 80 rows / 4 experts = 20 → 32
    assert predicted_block_m({**args, "block_m": 64}) == 64
    assert predicted_block_k(args) == 128  # 4-bit weights without native MXFP
    assert scale_bytes_read(args) == 23 * 128
    assert scale_bytes_read({**args, "block_k": 64}) == 2880


def test_gpt_oss_scales_at_k_2880_break_the_unmasked_scale_load_contract() -> None:
    args = gemm1_args(k=2880)
    violations = OP.check(args, check_device=False)
    assert [v.arg for v in violations] == ["precision_config.weight_scale.storage"]
    (violation,) = violations
    assert violation.aspect == "shape" and not violation.host_checked
    assert violation.actual == "(4, 2880, 16)" and violation.expected == "(4, 2944, 16)"
    assert "the kernel reads 2944 bytes per scale row" in violation.consequence
    assert "the tensor holds 2880" in violation.consequence
    # the last expert's last row reads 64 bytes past the allocation: the output may depend on what lies there
    assert violation.reads_past_end == 64 and violation.predicts_memory_dependence
    # a K tile that divides K, or a K that is a multiple of 128, keeps the reads inside each row
    assert OP.check({**args, "block_k": 64}, check_device=False) == []
    assert OP.check(gemm1_args(k=2816), check_device=False) == []
    assert OP.check(gemm2_args(k=2880), check_device=False)[0].arg == "precision_config.weight_scale.storage"


def test_contracts_see_inside_opaque_arguments() -> None:
    args = gemm2_args(k=128)
    flat = contract_args(args)
    assert flat["precision_config.weight_scale.storage"] is args["precision_config"].weight_scale.storage
    assert flat["w.storage"] is args["w"].storage
    assert (
        flat["routing_data.expt_data.block_pid_map[block_m]"]
        is args["routing_data"].expt_data.block_pid_map[16]
    )
    assert OP.check(args, check_device=False) == []
    bad = dict(args)
    bad["gammas"] = args["gammas"][:-1]
    bad["bias"] = args["bias"].to(torch.float64)[:, :128]
    bad["x"] = args["x"].float()
    bad["routing_data"] = dataclasses.replace(
        args["routing_data"],
        expt_data=dataclasses.replace(
            args["routing_data"].expt_data, hist=args["routing_data"].expt_hist.long()
        ),
    )
    found = {(v.arg, v.aspect) for v in OP.check(bad, check_device=False)}
    assert found == {
        ("x", "dtype"),
        ("y", "dtype"),  # the output dtype follows x
        ("bias", "dtype"),
        ("bias", "shape"),
        ("bias", "contiguity"),
        ("gammas", "shape"),
        ("routing_data.expt_data.hist", "dtype"),
    }
    assert any("cuda" in v.expected for v in OP.check(args))  # CPU tensors: the device contract fires


def test_a_batched_call_is_judged_by_its_own_shapes() -> None:
    """A 3-D ``x`` (one GEMM per batch entry, no routing): ``matmul_ogs`` allocates and asserts ``y`` as
    ``[batch, rows, N]`` — not ``[1, rows, N]`` — and ``x`` is ``[batch, rows, K]``."""
    g = torch.Generator().manual_seed(3)
    args = {
        **{spec.name: None for spec in OP.arguments},
        "x": torch.randn(3, 5, 64, generator=g).to(torch.bfloat16),
        "w": torch.randn(3, 64, 32, generator=g).to(torch.bfloat16),
        "y": torch.zeros(3, 5, 32, dtype=torch.bfloat16),
    }
    assert OP.check(args, check_device=False) == []
    (wrong,) = OP.check({**args, "y": torch.zeros(1, 5, 32, dtype=torch.bfloat16)}, check_device=False)
    assert (wrong.arg, wrong.aspect, wrong.expected, wrong.host_checked) == ("y", "shape", "(3, 5, 32)", True)


def test_a_three_dimensional_recorded_output_is_judged_by_its_elements(tmp_path: Any) -> None:
    """vLLM's gpt-oss path passes ``y`` as ``[1, rows, N]`` and ``matmul_ogs`` returns a 2-D view of it, so the
    capture records the 3-D buffer: the same elements as the reference's ``[rows, N]``, judged, never ``invalid``."""
    from moereplay.replay import Verdict, replay

    args = gemm2_args(k=128)
    output = OP.reference(args).output.to(torch.bfloat16).unsqueeze(0)
    path = tmp_path / "ogs.moe.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call(OP.name, args, site="test:gemm2")
        writer.complete_call(index, {"y": output})
    report = replay(path, backend="reference", device="cpu")
    assert report.recorded is not None and report.recorded.verdict is Verdict.OK, report.recorded
    assert report.recorded.rows == 6 and not report.failed
    damaged = output.clone()
    damaged[0, 2] *= 3
    path = tmp_path / "ogs-bad.moe.zst"
    with CaptureWriter(path) as writer:
        index = writer.begin_call(OP.name, args, site="test:gemm2")
        writer.complete_call(index, {"y": damaged})
    report = replay(path, backend="reference", device="cpu")
    assert report.recorded is not None and report.recorded.verdict is Verdict.CORRUPT
    assert report.recorded.bad_rows == 1 and report.headline.text == "corrupt (recorded)"


# ---------------------------------------------------------------------------------------------------------------
# reference glue and row meaning
# ---------------------------------------------------------------------------------------------------------------


def test_gemm2_reference_decomposes_into_per_slot_gemm_and_bias_times_the_routing_weight() -> None:
    args = gemm2_args(tokens=5, experts=4, top_k=2, k=128, n=64)
    result = OP.reference(args)
    assert result.output.shape == (5, 64) and bool(result.written.all())
    assert result.rows.token.tolist() == [0, 1, 2, 3, 4] and (result.rows.expert == -1).all()
    assert set(result.terms) == {f"{part}[slot {j}]" for part in ("gemm", "bias") for j in (0, 1)}
    rebuilt = sum(result.coefficients[name][:, None] * term for name, term in result.terms.items())
    assert torch.allclose(rebuilt, result.output, rtol=1e-5, atol=1e-5)
    # the coefficient of slot j of token t is the routing weight read from gammas at that slot's sorted row
    scatter, gammas = args["scatter_indx"], args["gammas"]
    source = result.sources["gemm[slot 1]"]
    assert source.arg == "gammas" and source.read_as == torch.bfloat16
    for token in range(5):
        sorted_row = int(scatter.src_indx[token * 2 + 1])
        assert int(source.index[token]) == sorted_row
        assert float(result.coefficients["gemm[slot 1]"][token]) == float(gammas[sorted_row])


def test_gemm1_rows_are_expert_sorted_slots_with_their_tile() -> None:
    args = gemm1_args(tokens=40, experts=4, top_k=2, k=128, n=64)
    result = OP.reference(args)
    rows = result.rows
    gather = args["gather_indx"].src_indx.long()
    assert rows.token.tolist() == (gather // 2).tolist() and rows.slot.tolist() == (gather % 2).tolist()
    offs = args["routing_data"].expt_data.token_offs_raw.long()
    expected_expert = torch.searchsorted(offs[1:], torch.arange(80), right=True)
    assert rows.expert.tolist() == expected_expert.tolist()
    block_m = predicted_block_m(args)  # 32
    tile_map = args["routing_data"].expt_data.block_pid_map[block_m]
    for row in (0, 17, 45, 79):
        tile = int(rows.block[row])
        expert, block = int(tile_map[tile]) & 0xFFFF, int(tile_map[tile]) >> 16
        assert expert == int(rows.expert[row])
        assert int(offs[expert]) + block * block_m <= row < int(offs[expert]) + (block + 1) * block_m
    assert result.terms == {}  # swiglu is not linear in the GEMM: no ingredients
    assert result.output.shape == (80, 32)


def test_op_reference_accepts_the_libraries_objects_too() -> None:
    library = _library_namespace()
    args = gemm2_args(k=128, n=64)
    built = {**args, **OP.library_args(args, library)}
    assert torch.equal(OP.reference(built).output, OP.reference(args).output)


def test_tensor_leaves_and_replacement_reach_the_swizzled_storage() -> None:
    args = gemm1_args(k=128)
    leaves = OP.tensor_leaves(args)
    assert leaves["precision_config.weight_scale.storage"] is args["precision_config"].weight_scale.storage
    assert "routing_data.expt_data.block_pid_map[128]" in leaves and "x" in leaves and "y" in leaves
    copy = leaves["precision_config.weight_scale.storage"].clone()
    swapped = OP.replace_tensor_leaves(args, {"precision_config.weight_scale.storage": copy})
    assert swapped["precision_config"].weight_scale.storage is copy
    assert swapped["w"].storage is args["w"].storage and swapped["x"] is args["x"]


def test_guard_bands_sit_right_after_the_swizzled_scale_storage_inside_the_precision_config() -> None:
    from moereplay.reference.hopper_mxfp4 import decode_e8m0_as_hopper_kernel, scale_overrun
    from moereplay.replay.memory import materialise
    from moereplay.replay.mutations import FillPattern

    args = gemm1_args(experts=2, k=2880, n=512)
    guarded = materialise(OP.tensor_leaves(args), "cpu", FillPattern(0xFF), guard=256)
    replayed = OP.replace_tensor_leaves(args, guarded.args)
    scale = replayed["precision_config"].weight_scale.storage
    original = args["precision_config"].weight_scale.storage
    assert scale is not original and torch.equal(scale, original) and scale.stride() == original.stride()
    # what the Hopper kernel reads from the last swizzled row of the last expert: ceil(K/128)·128 bytes from its
    # start (unmasked); the row holds 2880 — the rest comes from the guard band
    overrun = scale_overrun(512, 2880)
    assert (overrun.row_bytes, overrun.bytes_read, overrun.overrun) == (2880, 2944, 64)
    allocation = guarded.allocation_of("precision_config.weight_scale.storage")
    row_start = allocation.guard + allocation.span_bytes - overrun.row_bytes
    read = allocation.buffer[row_start : row_start + overrun.bytes_read]
    assert torch.equal(read[: overrun.row_bytes], original.mT.contiguous()[-1, -1])
    assert bool((read[overrun.row_bytes :] == 0xFF).all())
    assert torch.isinf(
        decode_e8m0_as_hopper_kernel(read[overrun.row_bytes :])
    ).all()  # 0·Inf = NaN in the dot
    assert guarded.damage() == []


def test_process_state_reads_the_opt_flags_constraints_in_force() -> None:
    import types

    from moereplay.ops.matmul_ogs import process_state

    state = process_state(types.SimpleNamespace(_opt_flags_constraints={"split_k": 1, "block_m": 32}))
    assert state["split_k"] == 1 and state["block_m"] == 32 and state["block_k"] is None
    assert state["num_warps"] is None and set(state) == set(argument_names(OP)[13:])


# ---------------------------------------------------------------------------------------------------------------
# the fidelity check's hooks: re-derived routing metadata, recorded and replayed process state
# ---------------------------------------------------------------------------------------------------------------


def _leaves_equal(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    left, right = OP.tensor_leaves(a), OP.tensor_leaves(b)
    return sorted(
        path
        for path in set(left) | set(right)
        if path not in left
        or path not in right
        or left[path].shape != right[path].shape
        or not torch.equal(
            left[path].reshape(-1).view(torch.uint8), right[path].reshape(-1).view(torch.uint8)
        )
    )


@pytest.mark.parametrize("make", [gemm1_args, gemm2_args], ids=["gather", "scatter"])
def test_routing_metadata_re_derives_to_what_the_routing_prepared_and_repairs_a_stale_copy(make: Any) -> None:
    args = make(k=128)
    assert _leaves_equal(args, OP.rederive_routing(args)) == []
    routing = args["routing_data"]
    stale_offsets = routing.expt_data.token_offs_raw.clone()
    stale_offsets[1:] = 0
    stale = {**args, "routing_data": dataclasses.replace(
        routing, expt_data=dataclasses.replace(routing.expt_data, token_offs_raw=stale_offsets)
    )}  # fmt: skip
    assert _leaves_equal(args, stale) == ["routing_data.expt_data.token_offs_raw"]
    assert _leaves_equal(args, OP.rederive_routing(stale)) == []


def test_the_recorded_opt_flags_are_the_process_state_and_some_can_be_pinned() -> None:
    chosen = {"block_m": 64, "block_n": 256, "block_k": 128, "split_k": 1, "arch": "sm90", "target": {"x": 1}}
    assert OP.recorded_state({"opt_flags": chosen}, {}) == {
        "block_m": 64,
        "block_n": 256,
        "block_k": 128,
        "split_k": 1,
        "arch": "sm90",
    }
    assert OP.recorded_state({}, {"opt_flags_override": {"block_m": 16}}) == {"block_m": 16}
    assert OP.recorded_state({}, {}) is None
    assert {"block_m", "block_k", "split_k", "num_stages"} <= set(OP.state_pins)
    assert "num_warps" not in OP.state_pins  # changing it re-swizzles the scales
    for argument in OP.state_pins.values():
        assert mutable_arg(OP, argument) is not None
