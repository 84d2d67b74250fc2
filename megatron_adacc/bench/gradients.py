"""`adacc bench gradients`: the one-step gradient error each op's layer-specific codec causes, beside plain INT4.

On megatron-core's tiny GPT (local spec, fixed weights and batch) and on a Llama-style tiny GPT (RMSNorm, SwiGLU,
RoPE, grouped-query attention, SDPA attention; :data:`~megatron_adacc.testing.TINY_LLAMA`), one forward and backward
keeps every saved activation to give the reference gradients. Then each op of every layer is stored compressed on
its own, once with the op's layer-specific codec (section 3.2 of the Adacc paper) and once with plain per-tensor
INT4, the paper's "Quantization" baseline. The last pair compresses every op at once (Adacc's codecs against
quantize-all). The error is ``||g - g_ref|| / ||g_ref||`` over all parameters' gradients. The forward is
exact under compression, so nothing else differs between the runs. Each op's row says whether its codec is at
least as good as plain INT4 there: below it, tied (within `TIE`), or behind (the two are equal where the op
stores nothing, or only tensors too small to compress).

This is the low-noise side of the paper's loss comparison (Fig. 6): loss curves at CPU scale differ by as
much between seeds as between methods, while this error is deterministic. The CPU run takes seconds;
``--quick`` changes nothing.
"""

from __future__ import annotations

from megatron_adacc.bench import harness
from megatron_adacc.core.log import Steps, echo
from megatron_adacc.core.tables import format_table

PLAIN = "int4_symmetric"
TIE = 0.01
"""A codec within this fraction above plain INT4's error ties with it. One fixed batch and set of weights decide
which values round up and which down: input_layernorm's outlier codec errs 0.1% above plain INT4 on the GeLU model
although none of its per-row steps is larger than plain INT4's (it takes outlier channels out of the rows)."""
#: The models, by name: :func:`~megatron_adacc.testing.build_tiny_gpt`'s keywords (the Llama-style one's are
#: looked up when the bench runs: ``testing`` loads torch).
MODELS = ("gelu", "llama")


def add_arguments(parser) -> None:
    parser.add_argument("--seed", type=int, default=5, help="Seed of the model's weights (default 5).")
    parser.add_argument("--model", choices=(*MODELS, "both"), default="both",
                        help="The tiny GeLU GPT (unfused attention), the Llama-style one (SDPA), or both (default).")


def run(args) -> dict:
    from megatron_adacc.adacc.policy.ops import OPS
    from megatron_adacc.testing import TINY_LLAMA

    names = MODELS if getattr(args, "model", "both") == "both" else (args.model,)
    overrides = {"gelu": {}, "llama": TINY_LLAMA}
    methods: dict[str, dict] = {}
    with Steps(len(names) * (len(OPS) + 1), "gradients") as step:
        for model in names:
            found = _errors(args.seed, overrides[model], step, model)
            echo(f"{model}:")
            echo(format_table(["op", "codec", "grad error", "plain INT4", "codec <= plain", "held KiB",
                               "plain INT4"],
                              [[name, m["codec"], f"{m['grad_rel_error']:.4f}", f"{m['plain_int4_grad_rel_error']:.4f}",
                                _verdict(m), f"{m['held_bytes'] / 1024:.1f}",
                                f"{m['plain_int4_held_bytes'] / 1024:.1f}"] for name, m in found.items()],
                              right=(2, 3, 5, 6)))
            methods.update({f"{model}/{name}": m for name, m in found.items()})
    harness.write_results("gradients", {"models": {m: "testing.build_tiny_gpt" + ("(**TINY_LLAMA)" if m == "llama"
                                                                                 else "()") for m in names},
                                        "seed": args.seed, "plain": PLAIN}, methods, args=args)
    return methods


def _verdict(m: dict) -> str:
    if m["grad_rel_error"] <= m["plain_int4_grad_rel_error"]:
        return "yes"
    return f"tie (+{m['grad_rel_error'] / m['plain_int4_grad_rel_error'] - 1:.1%})" if m["at_least_as_good"] else "NO"


def _errors(seed: int, overrides: dict, step: Steps, label: str) -> dict[str, dict]:
    """Per op (and ``all_ops``): the gradient error of its layer-specific codec and of plain INT4 on one model."""
    import megatron_adacc
    from megatron_adacc.adacc.policy.ops import OP_NAMES, OPS
    from megatron_adacc.adacc.policy.policy import Decision, Policy
    from megatron_adacc.adacc.runtime.memory import memory_report
    from megatron_adacc.testing import build_tiny_gpt, grad_rel_error, loss_and_grads, tiny_batch

    model = build_tiny_gpt(seed=seed, **overrides)
    model.train()
    batch = tiny_batch()
    layers = model.config.num_layers
    _, ref = loss_and_grads(model, batch)

    def error(policy: Policy) -> tuple[float, int]:
        """The gradient error under ``policy``, and the bytes the layers held for backward."""
        megatron_adacc.install(model.config, policy, predict_memory=False)
        try:
            _, grads = loss_and_grads(model, batch)
            held = memory_report(policy)["measured_bytes"]
        finally:
            megatron_adacc.uninstall()
        return grad_rel_error(grads, ref), held

    def only(op: str, codec: str) -> Policy:
        row = [Decision.compress(codec) if name == op else Decision("keep") for name in OP_NAMES]
        return Policy(layers=[row] * layers, name=f"{op}:{codec}")

    def pair(codec: str, specific: tuple[float, int], plain: tuple[float, int]) -> dict:
        # the bytes held say what each error costs: codecs keep different side data (plain INT4 one fp32 scale
        # per row, which on a 16-wide attention head is 2 bits an element; outlier channels stored exactly)
        return {"codec": codec, "grad_rel_error": specific[0], "plain_int4_grad_rel_error": plain[0],
                "at_least_as_good": specific[0] <= plain[0] * (1 + TIE), "held_bytes": specific[1],
                "plain_int4_held_bytes": plain[1]}

    found: dict[str, dict] = {}
    for spec in step.iterate(OPS, label=lambda spec: f"{label}: {spec.name}"):
        found[spec.name] = pair(spec.default_codec, error(only(spec.name, spec.default_codec)),
                                error(only(spec.name, PLAIN)))
    step(f"{label}: all ops")
    found["all_ops"] = pair("layer-specific", error(Policy.uniform("compress", layers)),
                            error(Policy.quantize_all(layers)))
    return found
