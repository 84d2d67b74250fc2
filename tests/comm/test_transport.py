"""ResiReduce's transports on 2, 4 and 8 gloo ranks: the compressed reduce-scatter against a reference written
out directly, error feedback that loses nothing, and bytes per rank that do not grow with the ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_adacc.comm.compressors.topk import OWNER_ENTRIES
from megatron_adacc.testing import torchrun_results

WORKER = Path(__file__).with_name("transport_worker.py")

#: ``transport:compressor:shard_only:average:async``. The identity and top-k make the reduction exact math, so the
#: transports must match the reference bit for bit.
EXACT = ["reduce-scatter:none:0:0:0", "reduce-scatter:topk:0:0:0", "reduce-scatter:topk:0:1:1",
         "reduce-scatter:topk:1:1:0", "reduce-scatter:topk:1:0:1", "allgather:topk:0:1:1"]
#: ``transport:compressor:shard_only``: stochastic and sampled compressors too.
CONSERVE = ["reduce-scatter:topk:0", "reduce-scatter:qsgd:0", "reduce-scatter:dgc:0", "reduce-scatter:qsgd:1"]
BYTES = ["auto:topk:0", "auto:topk:1", "allgather:topk:0", "reduce-scatter:topk:0", "reduce-scatter:topk:1",
         "allgather:qsgd:0", "reduce-scatter:qsgd:0"]


@pytest.fixture(scope="module")
def runs() -> dict[int, dict[str, dict]]:
    checks = [f"exact={s}" for s in EXACT] + [f"conserve={s}" for s in CONSERVE]
    return {n: torchrun_results(WORKER, checks + [f"bytes={s}" for s in BYTES], nproc=n, key="case")
            for n in (2, 4, 8)}


# Up to 4 ranks the owners keep every entry of a top-k sum; at 8 they drop some into their residuals.
@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("spec", EXACT)
def test_the_transport_equals_the_reference_bit_for_bit(runs, world, spec):
    r = runs[world][f"exact={spec}"]
    assert r["transport"] == spec.split(":")[0]
    assert r["mismatches"] == 0
    if spec.startswith("reduce-scatter:topk:0"):  # what the owners dropped went into their residuals
        assert (r["owner_residual_max"] > 0) == (world > OWNER_ENTRIES)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("spec", CONSERVE)
def test_error_feedback_keeps_what_the_compressions_drop(runs, world, spec):
    """Applied updates + the ranks' residuals + the owners' residuals = every gradient, to fp32 rounding."""
    r = runs[world][f"conserve={spec}"]
    assert r["max_error"] <= 1e-6 * r["scale"] * world
    # The owners keep the second compression's error; with the distributed optimizer there is none.
    assert (r["owner_residual_bytes"] > 0) == spec.endswith(":0")


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("spec", BYTES)
def test_counted_bytes_are_the_byte_models(runs, world, spec):
    """Per rank: what the wrapped torch.distributed counted = what the transport booked = the byte model."""
    for rank, (sent, received, booked_sent, booked_received, model_sent, model_received) in enumerate(
            runs[world][f"bytes={spec}"]["per_rank"]):
        assert sent == booked_sent == model_sent > 0, rank
        assert received == booked_received == model_received > 0, rank


def _busiest(runs, world: int, spec: str) -> tuple[int, int]:
    per_rank = runs[world][f"bytes={spec}"]["per_rank"]
    return max(r[0] for r in per_rank), max(r[1] for r in per_rank)


#: What the owners send back, in payloads of one rank: top-k keeps OWNER_ENTRIES times the entries of its sum, QSGD
#: requantizes it into the same int8 payload.
RETURNED = {"topk": OWNER_ENTRIES, "qsgd": 1}


@pytest.mark.parametrize("compressor", ["topk", "qsgd"])
def test_reduce_scatter_bytes_per_rank_do_not_grow_with_the_ranks(runs, compressor):
    payload = _busiest(runs, 2, f"allgather:{compressor}:0")[0]  # (N - 1) P at N = 2: one payload
    bound = (1 + RETURNED[compressor]) * payload
    for world in (2, 4, 8):
        gathered = _busiest(runs, world, f"allgather:{compressor}:0")
        assert gathered == ((world - 1) * payload,) * 2  # the all-gather grows as N - 1
        for direction in _busiest(runs, world, f"reduce-scatter:{compressor}:0"):
            # (N - 1) / N of a payload to the owners and of what they return, the ring law of Megatron's
            # uncompressed all-reduce, under a bound for any N; the rest is the rounding of pieces cut at the
            # shard boundaries (each a payload of its own).
            assert direction <= bound * 1.05
            assert direction == pytest.approx((world - 1) / world * bound, rel=0.05)
    scattered, gathered = (_busiest(runs, 8, f"{t}:{compressor}:0")[0] for t in ("reduce-scatter", "allgather"))
    assert scattered < 0.7 * gathered


def test_distributed_optimizer_needs_half_the_bytes(runs):
    """Only the own shard has to be reduced: one all-to-all, (N - 1) / N P."""
    payload = _busiest(runs, 2, "allgather:topk:0")[0]
    for world in (2, 4, 8):
        for direction in _busiest(runs, world, "reduce-scatter:topk:1"):
            assert direction == pytest.approx((world - 1) / world * payload, rel=0.05)


def test_auto_takes_the_fewer_bytes(runs):
    for world in (2, 4):  # one collective of (N - 1) P, against (1 + N) (N - 1) / N P
        assert runs[world]["bytes=auto:topk:0"]["transport"] == "allgather"
    assert runs[8]["bytes=auto:topk:0"]["transport"] == "reduce-scatter"  # 4.4 P against 7 P
    for world in (2, 4, 8):
        assert runs[world]["bytes=auto:topk:1"]["transport"] == "reduce-scatter"
