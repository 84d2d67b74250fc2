"""The cost model of the MILP: per-op choices with their memory and time, and the layer cost functions.

Two cost models share one problem description:

* ``paper`` (eq. 4): recomputing op i costs T_comp_i, compressing it T_c_i + T_dc_i, keeping it nothing.
* ``chain-aware``: consecutive recomputed ops form one segment recomputed from the nearest stored input, at
  the segment's own (measured) time ``segment_time(a, b)``; when that stored input is compressed it is
  decompressed once more for the recompute. With ``per_tensor=True`` every dropped tensor is
  rematerialized on its own from the nearest stored input, so an op whose input was also dropped costs
  the whole segment before it (``sum_k segment_time(a, k)``).

Memory is the same in both: eq. 7-8's M_static + N_layer x sum_i M_i x (CRate_i or 1 or 0), plus what the
paper leaves out and what decides whether a tight budget really holds: the backward. Its peak is bounded stage by
stage (in the spirit of Checkmate's per-stage memory and MONeT's bounds over all stages). A *stage* is the
backward of one op of a layer. The layer that runs its backward first (the last one) has every other layer's
stored bytes beside it, and at stage s it holds:

* the gradients of stage s (of op s's outputs and of what op s reads), whatever the policy;
* what its ops stored and autograd has not freed yet: a saved tensor is freed after the backward of the earliest
  op that reads it (profiled per op as ``freed``: the bytes freed after each reader), so stage s still holds
  those whose earliest reader is at or before s (a compressed op in the same proportion);
* a compressed op's decompressed copy, in the backward of each op that reads it (it is freed after it);
* a recompute segment's values, from the stage that first needs one of them (the latest reader of any, where
  the segment re-runs as a whole) down to the earliest reader of each, and its stored inputs (each output of a
  stored op before it that one of its ops reads, past the ops between too: under SDPA, ``context`` reads q, k and
  v from ``linear_qkv``) and RNG states until the re-run.

So the recompute segment of the MLP and a decompressed attention tensor, live at different stages, no longer
add up. The peak of a layer policy is the largest stage's bytes ``P``; ``P`` less what the layer stores is its
*backward excess* E (never negative: the first stage still holds everything). The backward runs from the last
layer to the first, and each layer frees what it stored, so layer l's excess sits beside the stored bytes of
layers 0..l only. The bound is ``M_fixed + max(every layer's stored bytes + workspace, max over l of (the stored
bytes of layers 0..l + E_l))``, where the workspace is the policy-independent transient at the start of
backward (the logits and their gradient), when every layer still holds all it stored. With one policy in every
layer that is ``M_fixed + N x stored + max(workspace, E)``, linear in the MILPs: one constraint per stage of the
representative layer, with the other layers' stored bytes as a sum. Where layers differ, a leaner layer below
richer ones is charged its re-materialization beside the layers below it only, not beside the whole model.

The forward of layer l runs beside the stored bytes of layers 0..l-1 too, so it is more stages of the same layer:
at op i's forward the layer holds what its ops before i stored (and the stored inputs of the segments begun by
then), the outputs later ops still read, and op i's own forward as the profiler measured it. A layer's excess E
is over its backward and forward stages. (The outputs still read are counted whether or not the policy stores
them: an upper bound, by what a kept op stores of its own live output.)

A keep-everything policy re-materializes nothing, so its peak is the stored activations and the gradients of
the first stage; a policy that drops every tensor re-materializes a whole layer during that layer's backward,
as Megatron's full recompute does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from megatron_adacc.adacc.policy.ops import (
    OPS,
    OPS_BY_NAME,
    RNG_OPS,
    TILED_OPS,
    Action,
    cross_reads,
    segments,
    split_reads,
)
from megatron_adacc.adacc.policy.policy import Decision
from megatron_adacc.adacc.policy.profile import LayerProfile, OpProfile
from megatron_adacc.models import UNFUSED

if TYPE_CHECKING:  # pareto imports this module
    from megatron_adacc.adacc.policy.pareto import ParetoPoint

# Python 3.11 looks enum members up through EnumType.__getattr__ (about 0.1 us each, ten times a string
# comparison); the checks below run in the inner loops of the Pareto DP and the MILP graph, so they compare
# with the members bound once here.
_KEEP, _COMPRESS, _RECOMPUTE = Action.KEEP, Action.COMPRESS, Action.RECOMPUTE

StageBytes = dict[int, float]
"""Bytes per backward stage (op index), for the stages something is live at."""


@dataclass(frozen=True)
class Choice:
    """One option for one op: its decision, the bytes it leaves stored, and its paper-model time."""

    decision: Decision
    memory_bytes: float
    time_s: float
    """T_comp (recompute), T_c + T_dc (compress) or 0 (keep)."""
    rerun_s: tuple[float, ...] = ()
    """Per output of the op (:attr:`Problem.outputs`, missing ones 0), the time a recompute segment that reads it
    pays beyond its re-run (the chain-aware model): for a compressed op, decompressing the output once more, or,
    where the op does not save it (a stash), compressing it in forward and decompressing it at the re-run."""
    stash: tuple[float, ...] = ()
    """Per output of the op (:attr:`Problem.outputs`, missing ones 0), the extra bytes to hold it as the stored
    input of a recompute segment that reads it, when it is not saved for backward anyway (the runtime holds it).
    The paper's eq. 8 ignores them; the chain-aware model counts them."""
    remat_bytes: float = 0.0
    """Bytes this choice brings back during its layer's backward (M_i for recompute and compress, 0 for keep);
    the stages they are live at come from the op's readers (:attr:`Problem.consumers`)."""

    @property
    def is_recompute(self) -> bool:
        """Whether the op joins a recompute segment (``Decision.in_segment``: a tiled MLP re-runs inside its
        own backward, :func:`tile_mlp`)."""
        return self.decision.in_segment


@dataclass
class Problem:
    """One layer's choices, repeated over ``num_layers`` identical layers, under a memory budget."""

    choices: list[list[Choice]]
    num_layers: int
    static_bytes: float
    budget_bytes: float | None
    segment_time: Callable[[int, int], float]
    """Time to recompute ops a..b (inclusive) as one segment from stored inputs."""
    workspace_bytes: float = 0.0
    rng_bytes: float = 0.0
    """Held by every recompute segment that contains an op of ``rng_ops`` (saved RNG states)."""
    rng_ops: frozenset[int] | None = None
    """Indices of ops that draw random numbers; defaults to those of the layer with unfused attention."""
    per_tensor: bool = False
    redecompress_segment_input: bool = True
    runtime_overhead_s: float = 0.0
    """Fixed time of a layer that runs through the runtime's op decomposition; a layer that keeps every
    activation runs megatron's own forward and does not pay it."""
    tile_overhead_s: float = 0.0
    """Time a tiled MLP re-run pays per tile beyond the first (:attr:`LayerProfile.tile_overhead_s`)."""
    layer_recompute_s: float | None = None
    """The time of a layer that keeps its input and recomputes everything else (:meth:`recomputes_whole_layer`),
    which runs megatron's own full recompute of it (:attr:`LayerProfile.layer_recompute_s`; a compressed input
    adds its codec's time); None: priced as the runtime's decomposition."""
    op_names: list[str] | None = None
    """Defaults to the transformer layer's ops when there are 13 choice lists, else ``op0, op1, ...``."""
    consumers: list[StageBytes] | None = None
    """Per op, ``{reader op index: bytes it reads}``: whose backward reads what the op holds (module docstring).
    Defaults to the next op reading all of it (the last op: itself)."""
    freed: list[StageBytes] | None = None
    """Per op, ``{op index: bytes}``: what autograd frees of the op's bytes after that op's backward (only the
    proportions count). Defaults to all of it after its earliest reader's."""
    grad_bytes: list[float] | None = None
    """Per op, the gradients live during its backward whatever the policy. Defaults to none."""
    output_bytes: list[float] | None = None
    """Per op, its outputs at full size. Defaults to the bytes it brings back when recomputed or compressed."""
    reads: tuple[tuple[int, int], ...] | None = None
    """``(producer, reader)`` op indices where the reader reads the producer's output past the ops between them
    (:func:`~.ops.cross_reads`). Defaults to the transformer layer's."""
    forward_bytes: list[float] | None = None
    """Per op, what its forward has live at its peak beyond what it reads (outputs, saved tensors, temporaries).
    None: the forward is not bounded (profiles without it)."""
    outputs: list[tuple[tuple[frozenset[int], float], ...]] | None = None
    """Per op, per output: the ops that read it and its bytes at full size. A recompute segment holding one of its
    readers holds it (:attr:`Choice.stash`, in this order) and decompresses it at the re-run when the op is stored
    compressed. Defaults to one output of :attr:`output_bytes`, read by the next op and by the op's readers past the
    ops between (:attr:`reads`)."""

    def __post_init__(self) -> None:
        if self.op_names is None:
            self.op_names = ([op.name for op in OPS] if len(self.choices) == len(OPS)
                             else [f"op{i}" for i in range(len(self.choices))])
        if self.reads is None:
            self.reads = cross_reads(self.op_names)
        if self.rng_ops is None:
            self.rng_ops = frozenset(i for i, name in enumerate(self.op_names)
                                     if name in OPS_BY_NAME and OPS_BY_NAME[name].uses_rng)
        if len(self.choices) != len(self.op_names):
            raise ValueError(f"{len(self.choices)} choice lists for {len(self.op_names)} ops")
        if any(c.is_recompute for c in self.choices[0]):
            raise ValueError("the first op is the layer's checkpoint and cannot be recomputed (eq. 6)")
        for i, cs in enumerate(self.choices):
            if not cs:
                raise ValueError(f"op {self.op_names[i]!r} has no choice")
            for c in cs:
                if c.memory_bytes < 0 or c.time_s < 0:
                    raise ValueError(f"op {self.op_names[i]!r}: negative memory or time in {c}")
        n = self.num_ops
        if self.consumers is None:
            self.consumers = [{min(i + 1, n - 1): max(c.remat_bytes for c in cs)} for i, cs in enumerate(self.choices)]
        if self.grad_bytes is None:
            self.grad_bytes = [0.0] * n
        if self.output_bytes is None:
            self.output_bytes = [max(c.remat_bytes for c in cs) for cs in self.choices]
        if self.freed is None:
            self.freed = [{min(readers, default=i): 1.0} for i, readers in enumerate(self.consumers)]
        if self.outputs is None:
            self.outputs = [((frozenset({i + 1} | {r for p, r in self.reads if p == i}), self.output_bytes[i]),)
                            for i in range(n)]
        if len(self.outputs) != n:
            raise ValueError(f"outputs needs one entry per op ({n})")
        self._read_cache: dict[tuple[int, int, int], tuple[int, ...]] = {}
        if not len(self.consumers) == len(self.freed) == len(self.grad_bytes) == len(self.output_bytes) == n:
            raise ValueError(f"consumers, freed, grad_bytes and output_bytes need one entry per op ({n})")
        for i, (readers, freed) in enumerate(zip(self.consumers, self.freed)):
            if any(c < i or c >= n for c in (*readers, *freed)) or not set(freed) <= set(readers) | {i}:
                raise ValueError(f"op {self.op_names[i]!r}: its bytes can only be read, and freed, by the backward "
                                 "of that op or of a later one that reads them")
        # the latest stage reading an op's bytes (-1: none), and the share of them still held at each stage
        self.reach = [max(readers, default=-1) for readers in self.consumers]
        self.held_share = [_held_share(freed, i, n) for i, freed in enumerate(self.freed)]
        if self.forward_bytes is not None and len(self.forward_bytes) != n:
            raise ValueError(f"forward_bytes needs one entry per op ({n})")
        self.forward_live: list[float] | None = None
        """Per op, what its forward has beside what the layer's ops before it stored: what it reads and what later
        ops still read (the outputs before it, whatever the policy: the runtime drops an output after its last
        reader), and its own forward (:attr:`forward_bytes`). None without them."""
        if self.forward_bytes is not None:
            self.forward_live = []
            for i, own in enumerate(self.forward_bytes):
                live = self.output_bytes[i - 1] if i else 0.0
                live += sum(self.output_bytes[p] for p, r in self.reads if p < i - 1 and r >= i)
                self.forward_live.append(live + own)

    @property
    def num_ops(self) -> int:
        return len(self.choices)

    @property
    def fixed_bytes(self) -> float:
        """What the stored decisions must fit beside: M_static (a layer's input is its first op's choice)."""
        return self.static_bytes

    def min_layer_memory(self) -> float:
        return sum(min(c.memory_bytes for c in cs) for cs in self.choices)

    def min_feasible_budget(self, *, stash: bool = False, heterogeneous: bool = False) -> int:
        """The smallest budget a strategy fits (with ``stash``, counting segment-input stashes). A policy used by
        every layer: the least ``fixed + N x stored + transient`` over the Pareto-optimal layer policies. With
        ``heterogeneous``, mixes of two of them too, the leaner in the lower layers, whose excess is charged
        beside those layers only (the heterogeneous strategy's mixes, :func:`pareto.least_mix_bytes`)."""
        from megatron_adacc.adacc.policy.pareto import least_mix_bytes, pareto_front  # pareto imports Problem

        front = pareto_front(self, chain_aware=stash)
        best = min(self.uniform_bytes(p) for p in front)
        if heterogeneous:
            best = min(best, least_mix_bytes(front, self.num_layers, self.workspace_bytes))
        return int(math.ceil(self.fixed_bytes + best))

    def uniform_bytes(self, point: ParetoPoint) -> float:
        """Bytes above the fixed ones of one layer policy (a :class:`~.pareto.ParetoPoint`) in every layer: every
        layer's stored bytes beside the workspace or the policy's backward excess."""
        return self.num_layers * point.memory_bytes + self.transient_bytes([point.excess_bytes])

    def transient_bytes(self, layer_excesses: Sequence[float]) -> float:
        """The transient peak on top of every layer's stored bytes: the workspace or the largest layer excess
        (backward or forward), whichever is larger (they are not live at the same time)."""
        return max([self.workspace_bytes, *layer_excesses])

    # ---------------------------------------------------------------------------------- backward stages
    def choice_stages(self, i: int, choice: Choice) -> StageBytes:
        """Where a stored choice of op ``i`` is live in its layer's backward: what it holds, each part until its
        earliest reader has run, and, compressed, the decompressed copy during each reader's backward."""
        out: StageBytes = {}
        if choice.memory_bytes:
            for s, share in self.held_share[i].items():
                out[s] = choice.memory_bytes * share
        if choice.decision.action == _COMPRESS:
            for s, nbytes in self.consumers[i].items():
                out[s] = out.get(s, 0.0) + nbytes
        return out

    def segment_stages(self, a: int, b: int, stored: Mapping[int, Choice], *, stash: bool,
                       rerun: int | None = None) -> StageBytes:
        """Where recompute segment ``a..b`` is live: each op's values from the re-run (at the latest reader of
        any of them) down to its earliest reader; with ``stash`` (the chain-aware model, which counts segment
        inputs and re-runs) its stored inputs and RNG states until the re-run, and at the re-run its working set:
        the inputs at full size that were stored compressed (decompressed) or that the segment changes (a copy),
        and the largest output of the segment that nothing saves (the scores softmax reads). ``stored``: the
        choices of the stored ops before it, by op index (at least of those whose outputs it reads). ``rerun``:
        the stage it re-runs at when a later segment re-runs it first (:meth:`reruns`); by default, that of its
        own latest reader."""
        rerun = max(self.reach[a:b + 1]) if rerun is None else rerun
        out: StageBytes = {}
        if rerun < 0:  # nothing of the segment is saved: it never re-runs
            return out
        if stash:
            out[rerun] = self.rerun_working_set(a, b, stored)
        for k in range(a, b + 1):
            nbytes = self.recompute_choice(k).remat_bytes
            for s, share in self.held_share[k].items():
                if s <= rerun:
                    out[s] = out.get(s, 0.0) + nbytes * share
        held = self.segment_memory(a, b, stored) if stash else 0.0
        if held:
            for s in range(rerun, self.num_ops):
                out[s] = out.get(s, 0.0) + held
        return out

    def recompute_choice(self, i: int) -> Choice:
        return next(c for c in self.choices[i] if c.is_recompute)

    def stage_bytes(self, picks: Sequence[int], *, stash: bool = False) -> list[float]:
        """The bytes a layer with ``picks`` holds at each stage of its backward (index s: op s's backward),
        gradients included."""
        total = list(self.grad_bytes)
        chosen = self._chosen(picks)
        for i, c in enumerate(chosen):
            if not c.is_recompute:
                for s, nbytes in self.choice_stages(i, c).items():
                    total[s] += nbytes
        working: dict[int, list[float]] = {}  # stage -> working sets of the segments re-running there
        pulled: set[int] = set()  # stages a split read re-runs an earlier segment at
        for seg, rerun, stored in self._segments(chosen):
            for s, nbytes in self.segment_stages(seg.start, seg.stop - 1, stored, stash=stash, rerun=rerun).items():
                total[s] += nbytes
            if stash and rerun >= 0:
                working.setdefault(rerun, []).append(self.rerun_working_set(seg.start, seg.stop - 1, stored))
                if rerun != max(self.reach[seg.start:seg.stop]):
                    pulled.add(rerun)
        for s in pulled:  # the segments re-run one after the other: one working set at a time
            total[s] -= sum(working[s]) - max(working[s])
        return total

    def _segments(self, chosen: Sequence[Choice]) -> list[tuple[range, int, dict[int, Choice]]]:
        """Each recompute segment of a layer storing ``chosen``, the stage it re-runs at (-1: never, :meth:`reruns`)
        and the stored choices before it, by op index."""
        segs = segments(c.is_recompute for c in chosen)
        return [(seg, rerun, _stored_before(chosen, seg.start)) for seg, rerun in zip(segs, self.reruns(segs))]

    def reruns(self, segs: Sequence[range]) -> list[int]:
        """The stage each of a layer's recompute segments ``segs`` re-runs at (-1: never): that of its latest reader,
        or a later segment's re-run that reads one of its outputs (:func:`~.ops.split_reads`), if that comes first
        in backward."""
        out = [max(self.reach[seg.start:seg.stop]) for seg in segs]
        for i in reversed(range(len(segs))):
            for later in range(i + 1, len(segs)):
                if out[later] >= 0 and any(p in segs[i] and r in segs[later] for p, r in self.reads):
                    out[i] = max(out[i], out[later])
        return out

    def splits_a_read(self, picks: Sequence[int]) -> bool:
        """Whether a layer with ``picks`` has a recompute segment reading what another one recomputes: the policies
        the solvers leave out (:func:`~.ops.split_reads`)."""
        return split_reads([c.is_recompute for c in self._chosen(picks)], self.reads)

    def layer_excess(self, picks: Sequence[int], *, stash: bool = False) -> float:
        """A layer's excess: its largest stage's bytes, backward or forward, less what it stores (module
        docstring)."""
        largest = max(self.stage_bytes(picks, stash=stash) + self.forward_stages(picks, stash=stash))
        return largest - self.layer_memory(picks, stash=stash)

    def forward_stages(self, picks: Sequence[int], *, stash: bool = False) -> list[float]:
        """The bytes a layer with ``picks`` holds at each op's forward (module docstring): what its ops before it
        stored, with ``stash`` the stored inputs of the segments begun by then, and :attr:`forward_live`. Empty
        without :attr:`forward_bytes`."""
        if self.forward_live is None:
            return []
        chosen = self._chosen(picks)
        begun = {seg.start: self.segment_memory(seg.start, seg.stop - 1, stored)
                 for seg, rerun, stored in self._segments(chosen) if rerun >= 0} if stash else {}
        out, held = [], 0.0
        for i, c in enumerate(chosen):
            held += begun.get(i, 0.0)
            out.append(held + self.forward_live[i])
            if not c.is_recompute:
                held += c.memory_bytes
        return out

    # ------------------------------------------------------------------------------- evaluating a layer
    def layer_memory(self, picks: Sequence[int], *, stash: bool = False) -> float:
        """Bytes one layer holds (eq. 8's sum), plus segment-input stashes when ``stash``."""
        chosen = self._chosen(picks)
        total = sum(c.memory_bytes for c in chosen)
        if stash:  # a segment that never re-runs holds nothing for it (the runtime drops it)
            total += sum(self.segment_memory(seg.start, seg.stop - 1, stored)
                         for seg, rerun, stored in self._segments(chosen) if rerun >= 0)
        return total

    def _chosen(self, picks: Sequence[int]) -> list[Choice]:
        return [self.choices[i][k] for i, k in enumerate(picks)]

    def segment_memory(self, a: int, b: int, stored: Mapping[int, Choice]) -> float:
        """Extra bytes a recompute segment a..b that re-runs holds: the outputs of stored ops before it that it reads
        and nothing else saves (``stored``: their choices by op index, as :meth:`segment_stages` takes them) and,
        with a dropout inside, the RNG states."""
        rng = self.rng_bytes if any(i in self.rng_ops for i in range(a, b + 1)) else 0.0
        return rng + sum(_per_output(c.stash, read) for _, c, read in self._reads(a, b, stored))

    def rerun_working_set(self, a: int, b: int, stored: Mapping[int, Choice]) -> float:
        """What recompute segment a..b has live only while it re-runs: its inputs at full size beside their stored
        form (:meth:`rerun_copies`) and the largest of its outputs that nothing saves (the scores softmax reads)."""
        unsaved = max(max(0.0, self.output_bytes[k] - self.recompute_choice(k).remat_bytes) for k in range(a, b + 1))
        return self.rerun_copies(a, b, stored) + unsaved

    def rerun_copies(self, a: int, b: int, stored: Mapping[int, Choice]) -> float:
        """The inputs recompute segment a..b has at full size beside its stored ones when it re-runs: those of the
        stored ops before it (``stored``, by op index) that were compressed (decompressed), and of op ``a - 1``
        those the segment changes in place (a copy: softmax masks the scores)."""
        total = 0.0
        for p, c, read in self._reads(a, b, stored):
            spec = OPS_BY_NAME.get(self.op_names[p]) if p == a - 1 else None
            copies = (c.decision.action == _COMPRESS) + bool(spec is not None and spec.changed_by_reader)
            if copies:
                total += copies * sum(self.outputs[p][v][1] for v in read)
        return total

    def _reads(self, a: int, b: int, stored: Mapping[int, Choice]) -> Iterator[tuple[int, Choice, tuple[int, ...]]]:
        """``(op, choice, outputs)`` for each of the ``stored`` ops before segment a..b whose outputs (indices into
        :attr:`outputs`) an op of the segment reads."""
        for p, c in stored.items():
            if p < a:
                key = (p, a, b)
                read = self._read_cache.get(key)
                if read is None:
                    read = self._read_cache[key] = tuple(v for v, (readers, _) in enumerate(self.outputs[p])
                                                         if any(a <= r <= b for r in readers))
                if read:
                    yield p, c, read

    def carries(self, p: int, choice: Choice, after: int) -> bool:
        """Whether a recompute segment after op ``after`` may hold or decompress an output of op ``p`` stored
        with ``choice``: the Pareto DP carries such choices past the stored ops between."""
        if not (choice.decision.action == _COMPRESS or any(choice.stash) or any(choice.rerun_s)):
            return False
        return any(r > after for readers, _ in self.outputs[p] for r in readers)

    def stock_picks(self) -> list[int] | None:
        """The keep-everything picks, or None when some op offers no keep choice."""
        picks = [next((k for k, c in enumerate(cs) if c.decision.action == Action.KEEP), None)
                 for cs in self.choices]
        return None if None in picks else picks

    def is_stock(self, picks: Sequence[int]) -> bool:
        """Whether a layer with ``picks`` keeps every activation (and so runs megatron's own forward)."""
        return all(c.decision.action == _KEEP for c in self._chosen(picks))

    def recomputes_whole_layer(self, picks: Sequence[int]) -> bool:
        """Whether a layer with ``picks`` stores its input (kept or compressed) and recomputes, untiled, every op
        that holds anything (an op with no output, the SDPA layer's scores, softmax and dropout, may say anything):
        the layer the runtime hands to megatron's own full recompute."""
        chosen = self._chosen(picks)
        if chosen[0].is_recompute:
            return False
        return all((c.is_recompute and c.decision.tiles == 1)
                   or (self.output_bytes is not None and self.output_bytes[i] == 0 and not c.memory_bytes)
                   for i, c in enumerate(chosen) if i > 0)

    def whole_recompute_picks(self) -> list[list[int]]:
        """Per way of storing the input (kept, each codec), the picks that recompute every other op, untiled;
        none where an op cannot."""
        rest = [next((k for k, c in enumerate(cs) if c.is_recompute and c.decision.tiles == 1), None)
                for cs in self.choices[1:]]
        if None in rest:
            return []
        return [[k, *rest] for k, c in enumerate(self.choices[0]) if not c.is_recompute]

    def layer_time(self, picks: Sequence[int], *, chain_aware: bool) -> float:
        """The per-layer overhead time of ``picks`` (one choice index per op) under either cost model."""
        if self.layer_recompute_s is not None and self.recomputes_whole_layer(picks):
            return self.layer_recompute_s + self.choices[0][picks[0]].time_s  # a compressed input: its codec
        fixed = 0.0 if self.is_stock(picks) else self.runtime_overhead_s
        if not chain_aware:
            return fixed + sum(self.choices[i][k].time_s for i, k in enumerate(picks))
        chosen = self._chosen(picks)
        starts = {seg.start: seg for seg in segments(c.is_recompute for c in chosen)}
        total = fixed
        for i, c in enumerate(chosen):  # in op order, so the sum rounds as it always has
            if i in starts:
                total += self.segment_cost(i, starts[i].stop - 1, _stored_before(chosen, i))
            elif not c.is_recompute:
                total += c.time_s
        return total

    def segment_cost(self, a: int, b: int, stored: Mapping[int, Choice]) -> float:
        """Chain-aware cost of the maximal recompute segment a..b: its re-run, and what reading the outputs of the
        stored ops before it costs (:attr:`Choice.rerun_s`; ``stored``: their choices by op index, as
        :meth:`segment_stages` takes them)."""
        if self.per_tensor:
            cost = sum(self.segment_time(a, k) for k in range(a, b + 1))
        else:
            cost = self.segment_time(a, b)
        if self.redecompress_segment_input:
            cost += sum(_per_output(c.rerun_s, read) for _, c, read in self._reads(a, b, stored))
        return cost

    def total_memory(self, layer_picks: Sequence[Sequence[int]], *, stash: bool = False) -> float:
        """The peak bound of layers ``layer_picks`` (layer 0 first; the module docstring)."""
        stored, transient = self.stored_and_transient(layer_picks, stash=stash)
        return self.fixed_bytes + stored + transient

    def stored_and_transient(self, layer_picks: Sequence[Sequence[int]], *, stash: bool = False
                             ) -> tuple[float, float]:
        """Every layer's stored bytes, and the peak's excess over them: the workspace at the start of backward,
        or a layer's largest stage beside what the layers below it still hold, whichever is larger."""
        per_policy: dict[tuple[int, ...], tuple[float, float]] = {}  # layers share a few policies
        below = 0.0
        peak = 0.0
        for picks in layer_picks:
            key = tuple(picks)
            if key not in per_policy:
                per_policy[key] = (self.layer_memory(picks, stash=stash), self.layer_excess(picks, stash=stash))
            memory, excess = per_policy[key]
            below += memory
            peak = max(peak, below + excess)
        return below, max(self.workspace_bytes, peak - below)

    def total_time(self, layer_picks: Sequence[Sequence[int]], *, chain_aware: bool) -> float:
        return sum(self.layer_time(p, chain_aware=chain_aware) for p in layer_picks)

    def decisions(self, picks: Sequence[int]) -> list[Decision]:
        return [self.choices[i][k].decision for i, k in enumerate(picks)]


def build_problem(profile: LayerProfile, budget_bytes: float | None, *, codecs: str = "default",
                  num_layers: int | None = None, static_bytes: float | None = None,
                  per_tensor: bool = False, redecompress_segment_input: bool = True,
                  only_codec: str | None = None, codec_params: dict[str, dict] | None = None,
                  codec_substitutes: dict[str, str] | None = None,
                  allow: Callable[[str, Decision], bool] | None = None) -> Problem:
    """The MILP's problem from a profile.

    ``codecs="default"`` offers each op the paper's three choices (keep, its layer-specific codec,
    recompute); ``codecs="all"`` offers every applicable codec the profile measured. ``only_codec`` offers
    that one codec instead (e.g. ``stochastic`` for ``--adacc-codec gact``) wherever it applies.
    ``codec_params`` sets the parameters written into compress decisions (e.g. the outlier Z threshold).
    ``codec_substitutes`` offers another codec in place of a default one where the op accepts it (e.g.
    ``{"int4_outlier": "int4_symmetric"}``: the paper's "Adacc w/o outlier" ablation).
    ``allow(op, decision)`` can veto choices.
    """
    if codecs not in ("default", "all"):
        raise ValueError(f"codecs must be 'default' or 'all', got {codecs!r}")
    cs_scale, rc_scale = profile.codec_time_scale, profile.recompute_time_scale
    choices: list[list[Choice]] = []
    for spec, op in zip(OPS, profile.ops):
        cs = [Choice(Decision.keep(), float(op.saved_bytes), 0.0, (), _stash(op, Action.KEEP))]
        names = spec.codecs if codecs == "all" else (spec.default_codec,)
        if codec_substitutes:
            names = tuple(dict.fromkeys(codec_substitutes.get(n, n) for n in names
                                        if codec_substitutes.get(n, n) in spec.codecs))
        if only_codec is not None:
            names = (only_codec,) if only_codec in spec.codecs else ()
        for codec in names:
            if codec not in op.codecs:
                continue
            cp = op.codecs[codec]
            params = (codec_params or {}).get(codec, {})
            # an op that saves nothing compresses nothing for backward: only a stash of its outputs costs time
            saves = op.saved_bytes > 0
            cs.append(Choice(Decision.compress(codec, **params), float(cp.compressed_bytes),
                             (cp.compress_time_s + cp.decompress_time_s) * cs_scale if saves else 0.0,
                             _rerun_times(op, codec, cs_scale), _stash(op, codec), float(op.saved_bytes)))
        if spec.recomputable:
            cs.append(Choice(Decision.recompute(), 0.0, op.forward_time_s * rc_scale,
                             remat_bytes=float(op.saved_bytes)))
        if allow is not None:
            cs = [c for c in cs if allow(spec.name, c.decision)]
        if not cs:
            raise ValueError(f"every choice of op {spec.name!r} was vetoed")
        choices.append(cs)
    return Problem(
        choices=choices,
        num_layers=int(num_layers if num_layers is not None else profile.signature["num_layers"]),
        static_bytes=float(profile.static_bytes if static_bytes is None else static_bytes),
        budget_bytes=budget_bytes,
        segment_time=profile.scaled_segment_time,
        workspace_bytes=float(profile.workspace_bytes),
        rng_bytes=float(profile.rng_bytes),
        rng_ops=frozenset(i for i, spec in enumerate(OPS) if spec.name in _rng_ops(profile)),
        per_tensor=per_tensor,
        redecompress_segment_input=redecompress_segment_input,
        runtime_overhead_s=float(profile.runtime_overhead_s),
        tile_overhead_s=float(profile.tile_overhead_s),
        layer_recompute_s=profile.layer_recompute_s,
        consumers=_by_index(profile, "consumers"),
        freed=_by_index(profile, "freed"),
        grad_bytes=[float(op.grad_bytes) for op in profile.ops],
        output_bytes=(None if any(op.output_bytes is None for op in profile.ops)
                      else [float(op.output_bytes) for op in profile.ops]),
        forward_bytes=(None if any(op.forward_bytes is None for op in profile.ops)
                       else [float(op.forward_bytes) for op in profile.ops]),
        outputs=_outputs(profile),
    )


def tile_mlp(problem: Problem, tiles: int, param_bytes: float) -> Problem:
    """``problem`` with the MLP's token-wise ops (:data:`~.ops.TILED_OPS`) re-run in ``tiles`` token tiles, their one
    choice (:mod:`megatron_adacc.adacc.runtime.tiled`); the other ops keep theirs.

    The block is one autograd node, whose backward is the last of its ops' stage (the first its backward reaches):
    the block's input (what ``pre_mlp_layernorm`` holds) is read there, not at ``linear_fc1``'s stage. What it holds
    there, beside the stage's other bytes: the gradients of its output and of its input at full size, the untiled
    re-run's largest stage (its values and gradients) over ``tiles``, and its weights' gradients twice (``param_bytes``
    each): their sum over the tiles and the tile's own, which autograd hands back together at the tile's end. Its
    forward holds its input and whole output beside the largest of its ops' forwards over ``tiles``. It stores
    nothing; an op output of it that a later segment stores is held as kept. Its time is the untiled re-run's (the
    same arithmetic) plus the measured cost of each further tile's calls (:func:`tiled_block_time`)."""
    if tiles < 2:
        return problem
    first, *inner, last = [problem.op_names.index(name) for name in TILED_OPS]
    block = (first, *inner, last)
    rerun = problem.segment_stages(first, last, {}, stash=False)
    working = max(problem.grad_bytes[s] + rerun.get(s, 0.0) for s in block)
    boundary = problem.output_bytes[last] + problem.output_bytes[first - 1]
    grad_bytes = list(problem.grad_bytes)
    for s in block:
        grad_bytes[s] = 0.0
    grad_bytes[last] = boundary + working / tiles + 2 * param_bytes
    # its FFN-wide values are never whole: nothing holds them past the block
    output_bytes = list(problem.output_bytes)
    forward_bytes = None if problem.forward_bytes is None else list(problem.forward_bytes)
    if forward_bytes is not None:
        largest = max(forward_bytes[i] for i in block)
        for i in block:
            forward_bytes[i] = 0.0
        forward_bytes[last] = problem.output_bytes[first - 1] + problem.output_bytes[last] + largest / tiles
    for i in block[:-1]:
        output_bytes[i] = 0.0
    keep = [next((c for c in problem.choices[i] if c.decision.action == _KEEP), None) for i in block]
    time_s = tiled_block_time(problem, tiles)
    choices = list(problem.choices)
    for i, kept in zip(block, keep):
        choices[i] = [Choice(Decision.recompute(tiles), 0.0, time_s if i == last else 0.0,
                             stash=kept.stash if kept is not None and i == last else ())]

    def moved(stages: StageBytes) -> StageBytes:  # what the block's ops read is read in the block's backward
        out: StageBytes = {}
        for s, nbytes in stages.items():
            out[last if s in block else s] = out.get(last if s in block else s, 0.0) + nbytes
        return out

    return replace(problem, choices=choices, grad_bytes=grad_bytes, output_bytes=output_bytes,
                   forward_bytes=forward_bytes,
                   consumers=[moved(c) if i not in block else {} for i, c in enumerate(problem.consumers)],
                   freed=[moved(f) if i not in block else {} for i, f in enumerate(problem.freed)])


def tiled_block_time(problem: Problem, tiles: int) -> float:
    """Time of one MLP re-run in ``tiles`` tiles under ``problem`` (untiled): its ops' as one segment, and
    :attr:`Problem.tile_overhead_s` for each tile beyond the first."""
    untiled = problem.segment_time(problem.op_names.index(TILED_OPS[0]), problem.op_names.index(TILED_OPS[-1]))
    return untiled + (tiles - 1) * problem.tile_overhead_s


def _rng_ops(profile: LayerProfile) -> frozenset[str]:
    """The ops of the profiled layer's core attention that draw random numbers (the unfused attention's for a
    core attention Adacc has no op table for, which it refuses to run)."""
    return RNG_OPS.get(profile.signature.get("attention"), RNG_OPS[UNFUSED])


def _stash(op: OpProfile, storage: str) -> tuple[float, ...]:
    """A choice's :attr:`Choice.stash` from its op's profile: per output, what storing it as ``storage`` holds."""
    return tuple(float(out.bytes.get(storage, 0)) for out in op.stash)


def _rerun_times(op: OpProfile, codec: str, scale: float) -> tuple[float, ...]:
    """A compress choice's :attr:`Choice.rerun_s` from its op's profile, whose codec times were measured on the op's
    outputs: each output's share (by size) of a decompression, or of a compression and a decompression where the
    op does not save it (a stash). Profiles without stashes: one output, decompressed when the op saves it."""
    cp = op.codecs[codec]
    if not op.stash:
        return (cp.decompress_time_s * scale if op.saved_bytes > 0 else 0.0,)
    total = sum(out.output_bytes for out in op.stash) or 1
    return tuple((cp.compress_time_s * bool(out.bytes.get(codec, 0)) + cp.decompress_time_s) * scale
                 * out.output_bytes / total for out in op.stash)


def _outputs(profile: LayerProfile) -> list[tuple[tuple[frozenset[int], float], ...]] | None:
    """:attr:`Problem.outputs` from a profile's stashes; None (the cost model's default) for profiles without them
    (shape formulas: an op of a measured one may have no output, the empty ops under SDPA)."""
    if not any(op.stash for op in profile.ops):
        return None
    index = {op.name: i for i, op in enumerate(profile.ops)}
    return [tuple((frozenset(index[r] for r in out.readers if r in index), float(out.output_bytes))
                  for out in op.stash) for op in profile.ops]


def _per_output(values: tuple[float, ...], read: tuple[int, ...]) -> float:
    """The sum of a choice's per-output ``values`` (:attr:`Choice.stash`, :attr:`Choice.rerun_s`) over the outputs
    ``read``; missing ones are 0."""
    return sum(values[v] for v in read if v < len(values))


def _stored_before(chosen: Sequence[Choice], a: int) -> dict[int, Choice]:
    """The stored choices of the ops before op ``a``, by op index."""
    return {i: c for i, c in enumerate(chosen[:a]) if not c.is_recompute}


def _by_index(profile: LayerProfile, field: str) -> list[StageBytes] | None:
    """A per-op ``{op name: bytes}`` field of the profile keyed by op index; None (the cost model's default) for
    profiles without it."""
    if any(getattr(op, field) is None for op in profile.ops):
        return None
    index = {op.name: i for i, op in enumerate(profile.ops)}
    return [{index[name]: float(nbytes) for name, nbytes in getattr(op, field).items()} for op in profile.ops]


def _held_share(freed: StageBytes, i: int, n: int) -> StageBytes:
    """``{stage: share}``: the share of op ``i``'s bytes still held at each stage of the backward (stages from
    n - 1 down): all of it until the first part is freed. An op whose bytes are unknown (none saved) is held
    whole until its own backward."""
    total = sum(freed.values())
    if total <= 0:
        return {s: 1.0 for s in range(i, n)}
    out: StageBytes = {}
    held = 0.0
    for s in range(min(freed), n):
        held += freed.get(s, 0.0)
        out[s] = held / total
    return out
