"""The Megatron-LM CPU harness: Megatron's modules see one CUDA device that is the CPU, nothing else does.

The harness is process-wide (an import hook and three patched methods), so each check runs in a fresh
interpreter. megatron-core stands in for Megatron-LM here; the CI tier runs the real training loop on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from megatron_adacc.testing import megatron_lm_cpu

REPO = Path(__file__).resolve().parents[2]


def _run(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_megatron_sees_one_cuda_device_and_nothing_else_does():
    found = _run("""
        import json, sys, types, torch
        import megatron.core.utils as before          # imported before install(): rebound by install()
        from megatron_adacc.testing import megatron_lm_cpu as harness
        harness.install()
        import megatron.core.tensor_parallel.random as mrandom   # imported after: rebound by the import hook
        import megatron_adacc.adacc.runtime.checkpoint, megatron_adacc.comm.communicator
        proxy = harness.TORCH_AS_SEEN_BY_MEGATRON
        leaks = sorted(name for name, m in list(sys.modules.items())
                       if isinstance(m, types.ModuleType) and name.split(".")[0] in ("torch", "megatron_adacc")
                       and vars(m).get("torch") is proxy)
        try:
            torch.zeros(1, device="cuda")
            ours_raise = False
        except (RuntimeError, AssertionError):
            ours_raise = True
        # Tensor.type() answers the CUDA name to callers in a megatron/ folder only.
        scope = {"torch": torch}
        exec(compile("answer = torch.zeros(1).type()", "/checkout/megatron/core/fake.py", "exec"), scope)
        print(json.dumps({
            "before_rebound": before.torch is proxy, "after_rebound": mrandom.torch is proxy,
            "lazy_call_rebound": getattr(mrandom, "_lazy_call", harness._lazy_call) is harness._lazy_call,
            "megatron_available": mrandom.torch.cuda.is_available(),
            "megatron_count": mrandom.torch.cuda.device_count(),
            "megatron_zeros_device": str(mrandom.torch.zeros(2, device="cuda").device),
            "megatron_type": scope["answer"], "our_type": torch.zeros(1).type(),
            "real_available": torch.cuda.is_available(), "ours_raise": ours_raise, "leaks": leaks,
            "cuda_is_self": torch.zeros(1).cuda().data_ptr() != 0,
        }))
    """)
    assert found["before_rebound"] and found["after_rebound"] and found["lazy_call_rebound"]
    assert found["megatron_available"] is True and found["megatron_count"] == 1
    assert found["megatron_zeros_device"] == "cpu"
    assert found["megatron_type"] == "torch.cuda.FloatTensor" and found["our_type"] == "torch.FloatTensor"
    assert found["real_available"] is False and found["ours_raise"] is True
    assert found["leaks"] == []  # no module of torch or megatron_adacc holds the proxy
    assert found["cuda_is_self"]


def test_the_cuda_generator_is_the_cpu_generator_and_lazy_calls_run_at_once():
    found = _run("""
        import json, torch
        from megatron_adacc.testing import megatron_lm_cpu as harness
        harness.install()
        cuda = harness.TORCH_AS_SEEN_BY_MEGATRON.cuda
        cuda.manual_seed(7)
        a = torch.rand(3).tolist()
        torch.manual_seed(7)
        b = torch.rand(3).tolist()
        state = cuda.get_rng_state()
        c = torch.rand(2).tolist()
        cuda.set_rng_state(state)
        d = torch.rand(2).tolist()
        ran = []
        cuda._lazy_call(lambda: ran.append(1))
        print(json.dumps({"seeded": a == b, "replayed": c == d, "ran": ran,
                          "generators": cuda.default_generators[0] is torch.default_generator,
                          "sm": cuda.get_device_capability()}))
    """)
    assert found == {"seeded": True, "replayed": True, "ran": [1], "generators": True, "sm": [8, 0]}


def test_a_data_loader_megatron_creates_leaves_the_generator_alone():
    found = _run("""
        import json, torch
        from megatron_adacc.testing import megatron_lm_cpu as harness
        harness.install()
        loader = torch.utils.data.DataLoader(list(range(4)))
        torch.manual_seed(0)
        scope = {"loader": loader}
        exec(compile("it = iter(loader)", "/checkout/megatron/training/training.py", "exec"), scope)
        after_megatron = torch.rand(1).item()
        torch.manual_seed(0)
        iter(loader)
        after_ours = torch.rand(1).item()
        torch.manual_seed(0)
        untouched = torch.rand(1).item()
        print(json.dumps({"megatron": after_megatron == untouched, "ours": after_ours == untouched}))
    """)
    assert found == {"megatron": True, "ours": False}


def test_it_refuses_to_install_where_a_gpu_exists(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(megatron_lm_cpu.CudaPresentError, match="CUDA device is present"):
        megatron_lm_cpu.install()
    assert not megatron_lm_cpu.is_installed()


def test_every_redirection_names_the_megatron_call_site_that_needs_it():
    keys = [r.key for r in megatron_lm_cpu.REDIRECTIONS]
    assert len(keys) == len(set(keys))
    for r in megatron_lm_cpu.REDIRECTIONS:
        assert r.what and r.why and any(ch.isdigit() for ch in r.needed_by), r
    # Every torch.cuda name the proxy answers itself is one the table lists.
    answered = set(vars(megatron_lm_cpu._CudaAsCpu())) - {"__name__", "__doc__", "__package__", "__loader__",
                                                        "__spec__"}
    table = " ".join(r.what for r in megatron_lm_cpu.REDIRECTIONS)
    assert [name for name in sorted(answered) if name not in table] == []


def test_a_script_runs_as_main_with_its_folder_first_on_the_path(tmp_path):
    (tmp_path / "helper_module.py").write_text("VALUE = 41\n")
    (tmp_path / "script.py").write_text(textwrap.dedent("""
        import sys, json, torch
        from helper_module import VALUE
        print(json.dumps({"name": __name__, "value": VALUE + 1, "argv": sys.argv[1:],
                          "cuda": torch.ones(1).cuda().device.type}))
    """))
    out = subprocess.run([sys.executable, "-m", "megatron_adacc.testing.megatron_lm_cpu", str(tmp_path / "script.py"),
                          "--flag", "x"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"name": "__main__", "value": 42,
                                                               "argv": ["--flag", "x"], "cuda": "cpu"}
