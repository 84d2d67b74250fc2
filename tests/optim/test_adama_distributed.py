"""Appendix B: 2 gloo ranks with N micro-batches each equal one process with 2N micro-batches."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from megatron_adacc.optim import AdamA

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import adama_dp_worker as worker  # noqa: E402  (a script beside this file, also run as a subprocess)

REPO = HERE.parent.parent


def test_two_ranks_equal_single_process_with_2n_microbatches(tmp_path):
    n, steps, world = 3, 4, 2
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1"}
    init_file = tmp_path / "rendezvous"
    procs = [subprocess.Popen([sys.executable, str(HERE / "adama_dp_worker.py"), str(init_file), str(r),
                               str(world), str(n), str(steps), str(tmp_path / f"rank{r}.pt")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(world)]
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0, out.decode()[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]

    model = worker.make_model()
    opt = AdamA(model.parameters(), num_microbatches=world * n, **worker.OPT_KW)
    worker.train(model, opt, worker.make_data(steps, world * n))

    for res in ranks:
        for p, q in zip(model.parameters(), res["params"]):
            torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6)
        for p, m, v in zip(model.parameters(), res["m"], res["v"]):
            torch.testing.assert_close(m, opt.state[p]["exp_avg"], rtol=1e-5, atol=1e-8)
            torch.testing.assert_close(v, opt.state[p]["exp_avg_sq"], rtol=1e-5, atol=1e-11)
    # Replicas stay bit-identical: every rank applies the same all-reduced states.
    for a, b in zip(ranks[0]["params"], ranks[1]["params"]):
        assert torch.equal(a, b)


def test_without_the_appendix_b_scaling_the_result_differs(tmp_path):
    """Guard against a vacuous comparison: plain averaging of v (no M*beta2, no /M^2) does not match."""
    n, world, steps = 2, 2, 3
    data = worker.make_data(steps, world * n)
    single = worker.make_model()
    opt = AdamA(single.parameters(), num_microbatches=world * n, **worker.OPT_KW)
    worker.train(single, opt, data)
    # Simulate 2 ranks in one process with per-rank optimizers and naive averaging of m and v.
    models = [worker.make_model() for _ in range(world)]
    opts = [AdamA(m.parameters(), num_microbatches=n, **worker.OPT_KW) for m in models]
    for mb in data:
        for r in range(world):
            for x, y in mb[r * n:(r + 1) * n]:
                torch.nn.functional.mse_loss(models[r](x), y).backward()
        for ps in zip(*(m.parameters() for m in models)):
            for key in ("exp_avg", "exp_avg_sq"):
                avg = sum(o.state[p][key] for o, p in zip(opts, ps)) / world
                for o, p in zip(opts, ps):
                    o.state[p][key].copy_(avg)
        for o in opts:
            o.step()
    v_naive = opts[0].state[next(models[0].parameters())]["exp_avg_sq"]
    v_true = opt.state[next(single.parameters())]["exp_avg_sq"]
    assert not torch.allclose(v_naive, v_true, rtol=1e-3)
