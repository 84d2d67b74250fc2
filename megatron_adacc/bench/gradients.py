"""`adacc bench gradients`: the one-step gradient error each op's layer-specific codec causes, beside plain INT4.

On megatron-core's tiny GPT (local spec, fixed weights and batch), one forward and backward keeps every
saved activation to give the reference gradients. Then each op of every layer is stored compressed on its
own, once with the op's layer-specific codec (section 3.2 of the Adacc paper) and once with plain per-tensor
INT4, the paper's "Quantization" baseline. The last pair compresses every op at once (Adacc's codecs against
quantize-all). The error is ``||g - g_ref|| / ||g_ref||`` over all parameters' gradients. The forward is
exact under compression, so nothing else differs between the runs.

This is the low-noise side of the paper's loss comparison (Fig. 6): loss curves at CPU scale differ by as
much between seeds as between methods, while this error is deterministic. The CPU run takes seconds;
``--quick`` changes nothing.
"""

from __future__ import annotations

from megatron_adacc.bench import harness
from megatron_adacc.core.log import Steps, echo
from megatron_adacc.core.tables import format_table

PLAIN = "int4_symmetric"


def add_arguments(parser) -> None:
    parser.add_argument("--seed", type=int, default=5, help="Seed of the model's weights (default 5).")


def run(args) -> dict:
    import megatron_adacc
    from megatron_adacc.adacc.policy.ops import OP_NAMES, OPS
    from megatron_adacc.adacc.policy.policy import Decision, Policy
    from megatron_adacc.testing import build_tiny_gpt, grad_rel_error, loss_and_grads, tiny_batch

    model = build_tiny_gpt(seed=args.seed)
    model.train()
    batch = tiny_batch()
    layers = model.config.num_layers
    _, ref = loss_and_grads(model, batch)

    def error(policy: Policy) -> float:
        megatron_adacc.install(model.config, policy, predict_memory=False)
        try:
            _, grads = loss_and_grads(model, batch)
        finally:
            megatron_adacc.uninstall()
        return grad_rel_error(grads, ref)

    def only(op: str, codec: str) -> Policy:
        row = [Decision.compress(codec) if name == op else Decision("keep") for name in OP_NAMES]
        return Policy(layers=[row] * layers, name=f"{op}:{codec}")

    methods: dict[str, dict] = {}
    with Steps(len(OPS) + 1, "gradients") as step:
        for spec in step.iterate(OPS, label=lambda spec: spec.name):
            specific = error(only(spec.name, spec.default_codec))
            plain = error(only(spec.name, PLAIN))
            methods[spec.name] = {"codec": spec.default_codec, "grad_rel_error": specific,
                                  "plain_int4_grad_rel_error": plain}
        step("all ops")
        methods["all_ops"] = {"codec": "layer-specific", "grad_rel_error": error(Policy.uniform("compress", layers)),
                              "plain_int4_grad_rel_error": error(Policy.quantize_all(layers))}

    echo(format_table(["op", "codec", "grad error", "plain INT4"],
                      [[name, m["codec"], f"{m['grad_rel_error']:.4f}", f"{m['plain_int4_grad_rel_error']:.4f}"]
                       for name, m in methods.items()], right=(2, 3)))
    harness.write_results("gradients", {"model": "testing.build_tiny_gpt", "seed": args.seed,
                                        "layers": layers, "plain": PLAIN}, methods, args=args)
    return methods
