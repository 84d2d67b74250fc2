"""The codec contract: restore dtype/shape/device, exact sizes, no reference to the input, clear errors,
NaN/Inf detection, empty/constant/zero inputs, and the per-codec error bounds on realistic data."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
from codec_test_utils import QUANTIZERS, activation_like, compress, ids, num_outliers

from megatron_adacc.codecs import CODEC_NAMES, NonFiniteInputError, get_codec

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def test_all_codec_names_are_registered():
    assert set(CODEC_NAMES) == {
        "keep", "int4_symmetric", "int4_asymmetric", "int4_channelwise", "int4_smoothed", "int4_outlier", "bitmask",
        "stochastic",
    }


@pytest.mark.parametrize(("name", "params"), QUANTIZERS, ids=ids(QUANTIZERS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_roundtrip_restores_metadata_and_size_formula(name, params, dtype):
    x = activation_like((6, 40, 96), dtype)
    codec = get_codec(name, **params)
    p = compress(codec, x)
    y = codec.decompress(p)
    assert (y.shape, y.dtype, y.device) == (x.shape, x.dtype, x.device)
    assert p.nbytes == codec.compressed_nbytes(x.shape, x.dtype, num_outliers=num_outliers(p))
    if min(params.get("group", 96), params.get("group_size", 96)) >= 32:  # tiny groups cost more than they save
        assert p.nbytes < x.numel() * x.element_size()


def test_size_formulas_by_hand():
    shape, f16 = (4, 10, 96), torch.float16  # 3840 values, rows 40, channels 96
    assert get_codec("keep").compressed_nbytes(shape, f16) == 7680
    assert get_codec("int4_symmetric").compressed_nbytes(shape, f16) == 1920 + 4 * 40
    assert get_codec("int4_symmetric", group=7).compressed_nbytes(shape, f16) == 548 * 4 + 2 + 4 * 549
    assert get_codec("int4_asymmetric").compressed_nbytes(shape, f16) == 1920 + 8 * 40
    assert get_codec("int4_channelwise").compressed_nbytes(shape, f16) == 1920 + 4 * 96
    assert get_codec("int4_smoothed").compressed_nbytes(shape, f16) == 1920 + 4 * 40 + 4 * 96
    assert get_codec("int4_outlier").compressed_nbytes(shape, f16, num_outliers=3) == 1920 + 160 + 40 * 3 * 2 + 12
    assert get_codec("bitmask").compressed_nbytes(shape, torch.bool) == 480
    assert get_codec("stochastic", bits=2, group_size=256).compressed_nbytes(shape, f16) == 960 + 8 * 15


def test_compression_ratios_on_fp16_activations():
    x = activation_like((512, 1024), torch.float16)
    ratio = {n: x.numel() * 2 / get_codec(n).compress(x).nbytes for n in ("int4_symmetric", "int4_channelwise")}
    assert ratio["int4_symmetric"] == pytest.approx(2048 / (512 + 4))
    assert ratio["int4_channelwise"] > 3.9
    m = torch.rand(512, 1024) < 0.9
    assert get_codec("bitmask").compress(m).nbytes * 8 == m.numel()


@pytest.mark.parametrize(("name", "params"), QUANTIZERS, ids=ids(QUANTIZERS))
def test_packed_holds_no_reference_to_the_input(name, params):
    x = activation_like((64, 128), torch.float32)
    ref = weakref.ref(x)
    codec = get_codec(name, **params)
    p = compress(codec, x)
    storages = [t.untyped_storage().data_ptr() for t in p.tensors.values()]
    assert x.untyped_storage().data_ptr() not in storages
    del x
    gc.collect()
    assert ref() is None
    assert p.nbytes > 0


@pytest.mark.parametrize(("name", "params"), QUANTIZERS, ids=ids(QUANTIZERS))
@pytest.mark.parametrize("bad_value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("position", [0, 37, -1], ids=["first", "middle", "last"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_finite_input_is_flagged_on_the_device_and_decodes_with_a_nan(name, params, bad_value, position, dtype):
    x = activation_like((5, 3, 41), dtype)
    x.view(-1)[position] = bad_value  # first, inside a vector block, and in the scalar tail
    codec = get_codec(name, **params)
    p = compress(codec, x)  # no exception: compress reads nothing on the host
    assert p.nonfinite is not None and int(p.nonfinite.reshape(-1)[0]) != 0
    y = codec.decompress(p)
    assert torch.isnan(y.view(-1)[0])  # nothing computed from it passes for finite
    with pytest.raises(NonFiniteInputError, match="NaN or Inf"):
        p.raise_if_nonfinite()
    assert issubclass(NonFiniteInputError, ValueError)


@pytest.mark.parametrize(("name", "params"), QUANTIZERS, ids=ids(QUANTIZERS))
def test_finite_input_is_not_flagged_and_decodes_untouched(name, params):
    x = activation_like((5, 3, 41), torch.float32)
    codec = get_codec(name, **params)
    p = compress(codec, x)
    assert int(p.nonfinite.reshape(-1)[0]) == 0
    p.raise_if_nonfinite()
    assert torch.isfinite(codec.decompress(p)).all()


@pytest.mark.parametrize(("name", "params"), QUANTIZERS, ids=ids(QUANTIZERS))
@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 5), (2, 0, 4)], ids=str)
def test_empty_tensors(name, params, shape):
    x = torch.empty(shape, dtype=torch.bfloat16)
    codec = get_codec(name, **params)
    p = compress(codec, x)
    y = codec.decompress(p)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert p.nbytes == codec.compressed_nbytes(shape, x.dtype, num_outliers=num_outliers(p))


@pytest.mark.parametrize(("name", "params"), QUANTIZERS, ids=ids(QUANTIZERS))
def test_scalar_tensor(name, params):
    x = torch.tensor(-1.75)
    codec = get_codec(name, **params)
    y = codec.decompress(compress(codec, x))
    assert y.shape == () and abs(y.item() + 1.75) <= 0.25


@pytest.mark.parametrize(("name", "params"), QUANTIZERS, ids=ids(QUANTIZERS))
@pytest.mark.parametrize("value", [0.0, -0.0, 3.0, -1e-3], ids=str)
def test_zero_and_constant_tensors_have_no_nan(name, params, value):
    x = torch.full((8, 50), value)
    codec = get_codec(name, **params)
    y = codec.decompress(compress(codec, x))
    assert torch.isfinite(y).all()
    if value == 0.0:
        assert (y == 0).all()
    if name in ("int4_asymmetric", "stochastic") or value <= 0:
        # Min/max codecs store the minimum itself; a negative constant is -8 * S with S = |value| / 8.
        assert torch.equal(y, x)
    else:
        # A positive constant is 7 * fl(value / 7): exact up to float32 rounding.
        assert torch.allclose(y, x, rtol=2e-7, atol=0)


def test_tiny_groups_are_flushed_without_nan():
    x = torch.tensor([1e-38, -3e-39, 0.0, 2e-45])  # normal, subnormal and the smallest subnormal
    for name in ("int4_symmetric", "int4_asymmetric", "stochastic"):
        y = compress_roundtrip(name, x)
        assert torch.isfinite(y).all() and (y - x).abs().max() <= 1e-37


def compress_roundtrip(name: str, x: torch.Tensor) -> torch.Tensor:
    codec = get_codec(name)
    return codec.decompress(compress(codec, x))


# ------------------------------------------------------------------------------------ error bounds
def _group_view(x: torch.Tensor, group: int) -> torch.Tensor:
    n = x.numel()
    return torch.nn.functional.pad(x.reshape(-1), (0, -n % group)).view(-1, group)


def test_symmetric_error_at_most_half_a_step():
    x = activation_like((64, 256), torch.float32)
    codec = get_codec("int4_symmetric", group=128)
    p = codec.compress(x)
    err = _group_view((x - codec.decompress(p)).abs(), 128)
    s = p.tensors["scales"]
    assert (err <= s[:, None] / 2 * (1 + 1e-6)).all()
    # The scale covers the group: max/7 for a positive extreme, -min/8 for a negative one.
    g = _group_view(x, 128)
    expected = torch.maximum(g.amax(1).clamp_min(0) / 7, -g.amin(1).clamp_max(0) / 8)
    assert torch.equal(s, expected)


def test_symmetric_paper_scale_would_clip_the_positive_maximum():
    # Why the scale differs from eq. 2: with S = max|x| / 8 the maximum 8 maps to code 8, clipped to 7.
    x = torch.tensor([8.0, -1.0, 0.0, 2.0])
    paper_s = 8.0 / 8
    assert (x / paper_s).round().clamp(-8, 7)[0] * paper_s == 7.0  # an error of a full step
    y = compress_roundtrip("int4_symmetric", x)
    assert y[0] == 8.0


def test_asymmetric_error_at_most_half_a_step_on_softmax_outputs():
    scores = torch.randn(16, 8, 64, 64)
    probs = torch.softmax(scores, dim=-1)
    codec = get_codec("int4_asymmetric")
    p = codec.compress(probs)
    y = codec.decompress(p)
    s = p.tensors["scales"].view(16, 8, 64, 1)
    assert ((probs - y).abs() <= s / 2 * (1 + 1e-5) + 1e-7).all()
    # Both ends of each row are represented (the paper's S = range/16 clips the maximum by one step).
    assert torch.allclose(y.amax(-1), probs.amax(-1), rtol=0, atol=1e-6)
    assert torch.allclose(y.amin(-1), probs.amin(-1), rtol=0, atol=1e-6)


def test_channelwise_error_at_most_half_a_step_per_channel():
    q = activation_like((4, 128, 8, 64), torch.float32)  # [s, b, heads, head_dim]
    codec = get_codec("int4_channelwise")
    p = codec.compress(q)
    s = p.tensors["scales"]
    assert s.shape == (64,)
    assert ((q - codec.decompress(p)).abs() <= s / 2 * (1 + 1e-6)).all()


def test_smoothed_is_plain_int4_where_no_channel_stands_out():
    q = torch.randn(4, 128, 8, 64)  # [s, b, heads, head_dim]: channels of like magnitude
    smoothed, plain = get_codec("int4_smoothed"), get_codec("int4_symmetric")
    p, r = smoothed.compress(q), plain.compress(q)
    assert torch.equal(p.tensors["factors"], torch.ones(64))
    assert all(torch.equal(p.tensors[key], r.tensors[key]) for key in ("payload", "scales"))
    assert torch.equal(smoothed.decompress(p), plain.decompress(r))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_smoothed_scales_outlier_channels_down_by_powers_of_two_and_errs_less(dtype):
    k = activation_like((4, 128, 8, 64), dtype)  # channels 0 and 1 are 30x the rest
    smoothed, plain, column = get_codec("int4_smoothed"), get_codec("int4_symmetric"), get_codec("int4_channelwise")
    p = smoothed.compress(k)
    f = p.tensors["factors"]
    assert (f[:2] == 1).all() and (f[2:] < 1).all()
    assert torch.equal(f, torch.exp2(torch.log2(f).round()))  # powers of two: the scaling is exact
    # Within half a step of the scaled row, per channel: |x - x_hat| <= f_j * S_r / 2.
    step = p.tensors["scales"].view(-1, 1) * f
    error = (k.float() - smoothed.decompress(p).float()).view(-1, 64).abs()
    assert (error <= step / 2 * (1 + 1e-5) + 2.0**-8 * k.float().abs().view(-1, 64)).all()

    def mse(codec):
        return (k.float() - codec.decompress(codec.compress(k)).float()).pow(2).mean()

    assert mse(smoothed) < 0.5 * mse(plain) and mse(smoothed) < mse(column)


@pytest.mark.parametrize(("outliers", "nan"), [(0, False), (2, False), (2, True)], ids=["like", "outliers", "nan"])
def test_smoothed_selects_on_the_device_what_the_host_picks(monkeypatch, outliers, nan):
    """On a GPU the codec makes both encodings and selects one without a host read; the result is the CPU's."""
    from megatron_adacc.codecs import int4

    k = activation_like((4, 128, 8, 64), torch.float32, outlier_channels=outliers)
    if nan:
        k[1, 2, 3, 4] = float("nan")
    codec = get_codec("int4_smoothed")
    host = codec.compress(k)
    monkeypatch.setattr(int4, "_host_reads_are_free", lambda device: False)
    device = codec.compress(k)
    for key in ("payload", "scales", "factors"):
        assert torch.equal(host.tensors[key].view(torch.uint8), device.tensors[key].view(torch.uint8)), key
    assert bool((host.tensors["factors"] == 1).all()) == (outliers == 0 or nan)
    assert int(host.nonfinite.item()) == int(device.nonfinite.item()) == int(nan)


@pytest.mark.parametrize("on_host", [True, False], ids=["cpu", "device"])
def test_smoothed_falls_back_to_plain_int4_where_a_sampled_factor_would_overflow(monkeypatch, on_host):
    """The factors come from every 7th row; a channel far larger in a skipped row overflows fp16 once divided by its
    factor, and the codec then stores plain INT4 (finite input never decodes to NaN or Inf)."""
    from megatron_adacc.codecs import int4

    monkeypatch.setattr(int4, "_host_reads_are_free", lambda device: on_host)
    x = torch.randn(700, 8)
    x[:, 0] *= 1000  # the sampled maximum: channel 1 gets a factor of 1/32
    x[1, 1] = 60000.0  # row 1 is not sampled; 60000 * 32 is past fp16's 65504
    x = x.half()
    smoothed, plain = get_codec("int4_smoothed"), get_codec("int4_symmetric")
    p = smoothed.compress(x)
    assert int(p.nonfinite.item()) == 0 and torch.equal(p.tensors["factors"], torch.ones(8))
    assert torch.equal(smoothed.decompress(p), plain.decompress(plain.compress(x)))


def test_smoothed_codes_in_chunks_change_no_bit(monkeypatch):
    from megatron_adacc.codecs import int4

    monkeypatch.setattr(int4, "SMOOTHING_CHUNK", 1000)  # several chunks on a small tensor
    k = activation_like((64, 96), torch.float32)
    codec = get_codec("int4_smoothed")
    whole = codec.decompress(codec.compress(k))
    monkeypatch.undo()
    assert torch.equal(whole, codec.decompress(codec.compress(k)))  # chunking changes no bit


def test_outlier_channels_are_exact_and_the_rest_within_half_a_step():
    x = torch.randn(256, 512)
    hot = torch.tensor([3, 100, 511])
    x[:, hot] *= 40
    codec = get_codec("int4_outlier", z_threshold=3.0)
    p = codec.compress(x)
    assert p.tensors["index"].tolist() == hot.tolist()
    y = codec.decompress(p)
    assert torch.equal(y[:, hot], x[:, hot])
    dense = x.clone()
    dense[:, hot] = 0
    s = p.tensors["scales"]
    assert torch.equal(s, torch.maximum(dense.amax(1).clamp_min(0) / 7, -dense.amin(1).clamp_max(0) / 8))
    assert ((x - y).abs() <= s[:, None] / 2 * (1 + 1e-6)).all()
    # Separating the outliers shrinks the error of everything else (the point of Adacc's scheme).
    plain = get_codec("int4_symmetric")
    err_plain = (x - plain.decompress(plain.compress(x)))[:, 200].abs().mean()
    assert (x - y)[:, 200].abs().mean() < err_plain / 5


def test_outlier_threshold_is_configurable():
    x = torch.randn(128, 64)
    x[:, 5] *= 6
    x[:, 9] *= 20
    assert get_codec("int4_outlier", z_threshold=3.0).compress(x).tensors["index"].tolist() == [9]
    assert get_codec("int4_outlier", z_threshold=1.0).compress(x).tensors["index"].tolist() == [5, 9]
    assert get_codec("int4_outlier", z_threshold=100.0).compress(x).tensors["index"].numel() == 0


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8])
def test_bitmask_is_exact(dtype):
    m = (torch.rand(3, 1000, 17) < 0.1).to(dtype)
    codec = get_codec("bitmask")
    y = codec.decompress(codec.compress(m))
    assert y.dtype == dtype and torch.equal(y, m)


# ------------------------------------------------------------------------------------ bad arguments
def test_unknown_codec_and_parameters_are_named():
    with pytest.raises(ValueError, match="unknown codec 'int3'.*int4_symmetric"):
        get_codec("int3")
    with pytest.raises(TypeError, match=r"unknown parameter\(s\) \['bits'\].*group"):
        get_codec("int4_symmetric", bits=4)
    with pytest.raises(ValueError, match="group"):
        get_codec("int4_symmetric", group=0)
    with pytest.raises(ValueError, match="bits must be one of"):
        get_codec("stochastic", bits=3)
    with pytest.raises(ValueError, match="group_size"):
        get_codec("stochastic", group_size=-1)
    with pytest.raises(ValueError, match="z_threshold"):
        get_codec("int4_outlier", z_threshold=float("nan"))


def test_wrong_dtypes_are_rejected_with_the_fix():
    with pytest.raises(TypeError, match="'keep' codec"):
        get_codec("int4_symmetric").compress(torch.ones(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="bool or uint8"):
        get_codec("bitmask").compress(torch.ones(4))
    with pytest.raises(ValueError, match="0 and 1"):
        get_codec("bitmask").compress(torch.tensor([0, 1, 2], dtype=torch.uint8))


def test_decompress_rejects_another_codecs_packed():
    p = get_codec("int4_symmetric").compress(torch.ones(8))
    with pytest.raises(ValueError, match="cannot decompress"):
        get_codec("int4_asymmetric").decompress(p)


def test_repr_and_params_roundtrip():
    codec = get_codec("stochastic", bits=2, group_size=64)
    assert get_codec(codec.name, **codec.params()).params() == {"bits": 2, "group_size": 64}
    assert "bits=2" in repr(codec)
    assert "int4_symmetric" in repr(get_codec("int4_symmetric").compress(torch.ones(3)))
    assert math.isclose(get_codec("int4_outlier").params()["z_threshold"], 3.0)
