"""``train.backend=static``: rollouts decoded from a static per-slot KV cache, the decode step a CUDA graph.

Why a backend of its own: decoding one token for the whole batch reads every weight once, so a
decode step of a 7B model is bound by the card's memory bandwidth (15.2 GB of bf16 weights at
4.8 TB/s: ~3 ms) as long as nothing else costs more. With ``hf`` something else does: every step
launches the model's few hundred kernels one by one from Python (~as long as the weights take to
read), and every turn re-encodes each episode's whole context. This backend keeps each episode's KV
cache between the turns of a rollout in fixed tensors and, on CUDA, replays the decode step as one
captured CUDA graph (``torch.cuda.CUDAGraph``). It samples in-process from the live model (the
trainer's own weights, LoRA adapter included: the graph reads the parameters where they live, and
the optimizer updates them in place), with the same warpers, stop ids and random stream as ``hf``:
what it samples is scored by the trainer within the dtype's floor (tests/test_generation_static.py).

What transformers and torch provide, used as they are:
  - ``transformers.cache_utils.StaticLayer``: the preallocated key/value tensors of one layer,
    marked as static addresses (what a captured graph needs), allocated on the first write;
  - ``transformers.cache_utils.Cache``: the per-layer container the models call ``update`` on;
  - the models' own forward with a prepared 4D attention mask (``masking_utils`` passes a 4D mask
    through as it is) and explicit ``position_ids``; ``logits_to_keep=1``;
  - the sampling warpers ``generate`` uses (``generation.sampling_warpers``: temperature, top-k,
    top-p), ``torch.multinomial`` on their softmax as ``generate`` samples;
  - ``torch.cuda.CUDAGraph`` / ``torch.cuda.graph`` for the decode step.

The backend itself is ``generation.StaticGenerator`` (beside the other backends: HFGenerator's
session, this module's engine); ``engine_for`` sizes the engine for each call.

What neither provides, written here (each says why at its definition):
  - ``SlotLayer``: per-slot write positions. ``StaticLayer`` writes every row of the batch at the
    same columns (one ``cumulative_length`` for the whole batch), which is ``generate``'s
    left-padded layout: episodes of different lengths would need their contexts re-aligned every
    turn. Here each slot (one episode) has its own length and is written at its own columns.
  - ``SlotEngine``: appending a tool result to a slot's context without re-encoding the rest (a
    context that extends what a slot holds is prefilled from where the slot ends: ``generate``
    has no call that continues some rows of an existing cache), identical contexts in one call
    prefilled once and copied (a GRPO group's G copies of a prompt), and slot reuse (a slot whose
    episode ended takes the next new context). transformers' continuous batching
    (``train.backend=paged``) schedules and reuses cache pages, but without flash-attn its
    ``paged|sdpa`` path attends over the whole packed batch with a dense mask and turns its CUDA
    graphs off (``continuous_batching/initialization.py``: graphs only where no mask is needed),
    which is why it measured slower than ``hf`` on an H200 (docs/howto/gpu.md).

Layout: each layer's cache is ``(slots, kv_heads, columns, head_dim)``. Column 0 is a trash
column: padding queries of a prefill and slots that are not decoding write there and attend to it
alone, and no real query ever attends to it. Slot ``s`` holds its episode's tokens at columns
``1 .. length_s`` (position id = column - 1: contiguous from 0, so RoPE sees each episode's own
positions). A real query at column ``c`` attends to columns ``1 .. c`` of its own slot: every
attention row has at least one column (no NaN from an empty softmax). Eager forwards (every
prefill; the decode step without graphs) attend only to the columns in use so far (``window``); a
captured decode step attends to all of them (one shape for the graph).

The cache stays allocated between rollouts (the job's one generator; a captured graph is tied to
its addresses): slots x columns x 2 x layers x kv_heads x head_dim x dtype bytes (Qwen2.5-7B in
bf16: 57 kB per token, 64 slots x 1,024 columns = 3.8 GB). What a slot holds is forgotten at the
start of every session (the weights change between rollouts); it grows (reallocated, copied, graph
captured again) when a call needs more slots or columns. On a CPU the same code runs eagerly.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

COLUMN_ROUND = 128  # cache columns are allocated in multiples of this (fewer reallocations and graph captures)
GROWTH = 1.5  # a cache that must grow takes at least this multiple of its columns (later turns are longer)
PREFILL_TOKENS = 16_384  # query tokens per prefill forward (activations; the mask is rows x width x columns)
PREFILL_MASK_ELEMENTS = 2**28  # ... and at most this many mask entries (256 MB of bool)
GRAPH_WARMUP_STEPS = 2  # eager decode steps on a side stream before capture (torch.cuda.graph's documented recipe)
ATTENTION_SUPPORTED = ("sdpa", "eager")  # take a prepared 4D mask; others are switched to sdpa for a session
TRASH = 0  # the cache column no real query reads (see the layout above)


# ---------------------------------------------------------------- the cache
@dataclass
class SlotState:
    """Where the forward running now writes: shared by every ``SlotLayer`` of one cache.

    ``rows``: the slots of this forward, ``None`` = every slot, one query each (the decode step);
    ``cols``: (rows, queries) cache column of each query (``TRASH`` for padding);
    ``window``: the columns the forward attends to, ``0 .. window - 1`` (``None``: all)."""

    slots: int
    columns: int  # including the trash column
    rows: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    window: int | None = None

    @property
    def capacity(self) -> int:
        """Tokens a slot can hold."""
        return self.columns - 1


@functools.cache
def _layer_class() -> type:
    from transformers.cache_utils import StaticLayer

    class SlotLayer(StaticLayer):
        """A ``StaticLayer`` whose rows are written at their own columns.

        Why by hand: ``StaticLayer.update`` writes all rows at ``cumulative_length + arange(q)``, one
        offset for the batch; a slot cache needs each row at its own length, and a prefill that
        fills only some slots (``state.rows``)."""

        def __init__(self, state: SlotState):
            super().__init__(max_cache_len=state.columns)
            self.state = state

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            # StaticLayer sizes its batch from the first write's; a prefill writes only some slots
            s = self.state.slots
            super().lazy_initialization(key_states.new_zeros((s, key_states.shape[1], 0, key_states.shape[-1])),
                                        value_states.new_zeros((s, value_states.shape[1], 0, value_states.shape[-1])))

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            st = self.state
            window = st.window or self.max_cache_len
            if st.rows is None:  # every slot, one query at its own column: scatter (capturable, no host sync)
                k_index = st.cols.view(-1, 1, 1, 1).expand(-1, key_states.shape[1], 1, key_states.shape[-1])
                v_index = st.cols.view(-1, 1, 1, 1).expand(-1, value_states.shape[1], 1, value_states.shape[-1])
                self.keys.scatter_(2, k_index, key_states)
                self.values.scatter_(2, v_index, value_states)
                return self.keys[:, :, :window], self.values[:, :, :window]
            rows = st.rows[:, None]  # (b, 1) with cols (b, w): the (b, w, heads, dim) entries of these slots
            self.keys[rows, :, st.cols] = key_states.transpose(1, 2)
            self.values[rows, :, st.cols] = value_states.transpose(1, 2)
            return self.keys[st.rows, :, :window], self.values[st.rows, :, :window]

        def get_seq_length(self) -> int:
            return 0  # no one length: each slot has its own (the models read it only without position_ids)

    return SlotLayer


def full_attention_layers(config: Any) -> int:
    """The model's number of decoder layers, when every one is full attention (else a clear error)."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    types, _ = get_layer_types_and_kwargs(text)
    other = sorted({t for t in types if t != "full_attention"})
    if other:
        raise ValueError(f"train.backend=static: {type(config).__name__} has {', '.join(other)} layers; this backend's "
                         "one attention mask is a full-attention mask (Qwen2.5, Qwen3, Llama-3.1). Use train.backend=hf")
    return len(types)


def slot_cache(config: Any, state: SlotState) -> Any:
    from transformers.cache_utils import Cache

    layer = _layer_class()
    return Cache(layers=[layer(state) for _ in range(full_attention_layers(config))])


# ---------------------------------------------------------------- the engine
@dataclass
class Plan:
    """Where each context of a call goes: its slot, how much of it the slot already holds, and the
    context it copies its prefill from (an identical one earlier in the call), if any."""

    slot: list[int] = field(default_factory=list)
    keep: list[int] = field(default_factory=list)  # tokens of the context already in the slot (not prefilled)
    leader: list[int] = field(default_factory=list)  # index of the context whose prefill it copies (itself if none)


class SlotEngine:
    """The cache, its slots' contents and the decode step of one model on one device.

    ``cached[s]``: the token ids whose keys/values slot ``s`` holds at columns ``1 .. len``.
    Counters (read by tests and the benchmark): ``prefilled`` tokens run through prefill forwards,
    ``decode_steps``, ``captures`` of the decode graph."""

    def __init__(self, model: Any, slots: int, columns: int, graphs: bool):
        self.device = next(model.parameters()).device
        self.state = SlotState(slots=slots, columns=columns)
        self.cache = slot_cache(model.config, self.state)
        self.cached: list[list[int]] = [[] for _ in range(slots)]
        self.ids = torch.zeros((slots, 1), dtype=torch.long, device=self.device)  # the decode step's inputs
        self.cols = torch.full((slots,), TRASH, dtype=torch.long, device=self.device)
        self.kv_columns = torch.arange(columns, device=self.device)
        self.graphs = graphs
        self.graph: Any = None
        self.graph_logits: torch.Tensor | None = None
        self.graph_key: tuple | None = None
        self.graph_error: str | None = None
        self.graph_checked = False  # this session's parameters checked against the graph's (once a session)
        self.prefilled = self.decode_steps = self.captures = 0

    @property
    def slots(self) -> int:
        return self.state.slots

    @property
    def columns(self) -> int:
        return self.state.columns

    # -- one forward
    def _mask(self, model: Any, cols: torch.Tensor, window: int) -> torch.Tensor:
        """(rows, 1, queries, window): a query at column c >= 1 sees its slot's columns 1 .. c; a padding
        query (the trash column) sees the trash column alone."""
        kv = self.kv_columns[:window].view(1, 1, 1, -1)
        q = cols[:, None, :, None]
        allowed = (kv <= q) & ((kv != TRASH) | (q == TRASH))
        if model.config._attn_implementation == "sdpa":
            return allowed
        dtype = next(model.parameters()).dtype  # eager attention adds the mask to its scores
        return torch.zeros(allowed.shape, dtype=dtype, device=self.device).masked_fill_(~allowed, torch.finfo(dtype).min)

    def _forward(self, model: Any, ids: torch.Tensor, cols: torch.Tensor, rows: torch.Tensor | None,
                 window: int | None = None) -> torch.Tensor:
        """Logits (rows, vocab) of each row's last query; its keys/values written at ``cols``; attention
        over columns ``0 .. window - 1`` (all when None)."""
        window = min(window or self.columns, self.columns)
        self.state.rows, self.state.cols, self.state.window = rows, cols, window
        positions = (cols - 1).clamp_(min=0)  # position = column - 1; padding at 0
        out = model(input_ids=ids, position_ids=positions, attention_mask=self._mask(model, cols, window),
                    past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1]

    def _decode_eager(self, model: Any, window: int | None = None) -> torch.Tensor:
        return self._forward(model, self.ids, self.cols[:, None], None, window)

    def decode(self, model: Any, window: int) -> torch.Tensor:
        """One decode step over every slot (``self.ids`` at ``self.cols``): logits (slots, vocab).
        ``window``: columns in use (eager only: a captured step attends to every column)."""
        self.decode_steps += 1
        if self.graphs and not self.graph_checked:
            self.graph_checked = True
            self._graph_ready(model)  # the parameters cannot move within a session: checked once
        if self.graphs and self.graph is not None:
            self.graph.replay()
            return self.graph_logits
        return self._decode_eager(model, window)

    def _graph_ready(self, model: Any) -> bool:
        """Capture the decode step as a CUDA graph for ``model``'s current parameters (again when
        they moved: a graph reads fixed addresses). False (eager from then on) if capture fails."""
        key = (id(model), model.config._attn_implementation, tuple(p.data_ptr() for p in model.parameters()))
        if self.graph is not None and self.graph_key == key:
            return True
        saved = self.cols.clone()
        try:
            self.cols.fill_(TRASH)  # warm-up and capture run real steps: into the trash column
            # Under an outer autocast, casts of the (float32) LoRA weights cached by an earlier forward would
            # be read by the capture as they are: cleared, the capture records the casts, and every replay
            # casts the live weights again (torch.cuda.graph's note on autocast caching).
            torch.clear_autocast_cache()
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(GRAPH_WARMUP_STEPS):
                    self._decode_eager(model)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            torch.clear_autocast_cache()
            with torch.cuda.graph(graph):
                logits = self._decode_eager(model)
        except Exception as exc:  # noqa: BLE001 - any capture failure: decode eagerly, and say so
            self.graphs, self.graph, self.graph_error = False, None, f"{type(exc).__name__}: {exc}"
            log.warning("train.backend=static: capturing the decode step as a CUDA graph failed (%s); decoding "
                        "eagerly", self.graph_error)
            return False
        finally:
            self.cols.copy_(saved)
        self.graph, self.graph_logits, self.graph_key = graph, logits, key
        self.captures += 1
        return True

    # -- a call
    def fits(self, contexts: list[list[int]], limits: list[int]) -> bool:
        need = max(len(c) + m for c, m in zip(contexts, limits, strict=True))
        return len(contexts) <= self.slots and need <= self.state.capacity

    def grown(self, model: Any, contexts: list[list[int]], limits: list[int]) -> SlotEngine:
        """A larger engine holding this one's slots (keys, values, ids): for a call that does not fit."""
        need = max(len(c) + m for c, m in zip(contexts, limits, strict=True))
        held = self.state.capacity
        capacity = max(need, int(GROWTH * held)) if need > held else held
        new = SlotEngine(model, max(self.slots, len(contexts)), round_columns(capacity) + 1, self.graphs)
        for old_layer, layer in zip(self.cache.layers, new.cache.layers, strict=True):
            if old_layer.is_initialized:
                layer.lazy_initialization(old_layer.keys, old_layer.values)
                layer.keys[: self.slots, :, : self.columns] = old_layer.keys
                layer.values[: self.slots, :, : self.columns] = old_layer.values
        new.cached[: self.slots] = self.cached
        new.prefilled, new.decode_steps, new.captures = self.prefilled, self.decode_steps, self.captures
        return new

    def forget(self) -> None:
        """Nothing a slot holds is valid any more (new weights): every context is prefilled again."""
        self.cached = [[] for _ in range(self.slots)]
        self.graph_checked = False

    def plan(self, contexts: list[list[int]]) -> Plan:
        """Slots for the contexts of one call (host-side bookkeeping, no tensor work).

        A context that extends what a slot holds continues in that slot (the longest such slot):
        only its new tokens are prefilled. An identical context earlier in the call is its leader:
        prefilled once, copied. Everything else takes a slot no context of this call uses, emptiest
        first: a slot whose episode has ended is reused."""
        plan = Plan()
        first: dict[tuple, int] = {}
        taken: set[int] = set()
        pending: list[int] = []
        for i, c in enumerate(contexts):
            if not c:
                raise ValueError(f"train.backend=static: context {i} of the call is empty")
            leader = first.setdefault(tuple(c), i)
            plan.leader.append(leader)
            plan.slot.append(-1)
            plan.keep.append(0)
            if leader != i:
                pending.append(i)
                continue
            best, held = -1, 0
            for s, ids in enumerate(self.cached):
                n = len(ids)
                if s in taken or n <= held or n > len(c) or c[n - 1] != ids[-1] or c[:n] != ids:
                    continue
                best, held = s, n
            if best >= 0:
                taken.add(best)
                plan.slot[i], plan.keep[i] = best, min(held, len(c) - 1)  # the last token always runs: its logits
            else:
                pending.append(i)
        free = sorted((s for s in range(self.slots) if s not in taken), key=lambda s: len(self.cached[s]))
        if len(pending) > len(free):  # fits() sized the cache for the call: a slot for every context
            raise RuntimeError(f"slot cache of {self.slots} slots planned {len(contexts)} contexts")
        for i, s in zip(pending, free, strict=False):
            plan.slot[i] = s
        return plan

    def prefill(self, model: Any, contexts: list[list[int]], plan: Plan) -> torch.Tensor:
        """Run every leader's new tokens into its slot; copy leaders' slots to their followers.
        Returns (contexts, vocab) logits of each context's last token."""
        leaders = [i for i in range(len(contexts)) if plan.leader[i] == i]
        leaders.sort(key=lambda i: len(contexts[i]) - plan.keep[i])  # similar widths together: less padding
        logits: dict[int, torch.Tensor] = {}
        start = 0
        while start < len(leaders):
            width = len(contexts[leaders[start]]) - plan.keep[leaders[start]]
            end = start + 1
            while end < len(leaders):
                w = max(width, len(contexts[leaders[end]]) - plan.keep[leaders[end]])
                rows = end - start + 1
                if rows * w > PREFILL_TOKENS or rows * w * self.columns > PREFILL_MASK_ELEMENTS:
                    break
                width, end = w, end + 1
            chunk = leaders[start:end]
            ids = torch.zeros((len(chunk), width), dtype=torch.long)
            cols = torch.full((len(chunk), width), TRASH, dtype=torch.long)
            for r, i in enumerate(chunk):  # left padding: every row's last token in the last query
                new = contexts[i][plan.keep[i]:]
                ids[r, width - len(new):] = torch.tensor(new, dtype=torch.long)
                cols[r, width - len(new):] = torch.arange(plan.keep[i], len(contexts[i])) + 1  # column = position + 1
                self.prefilled += len(new)
            rows = torch.tensor([plan.slot[i] for i in chunk], dtype=torch.long, device=self.device)
            window = max(len(contexts[i]) for i in chunk) + 1
            out = self._forward(model, ids.to(self.device), cols.to(self.device), rows, window)
            for r, i in enumerate(chunk):
                logits[i] = out[r]
            start = end
        self.state.rows = self.state.cols = self.state.window = None
        followers = [i for i in range(len(contexts)) if plan.leader[i] != i]
        if followers:  # a group's copies of one prompt: the leader's keys and values, copied whole
            src = torch.tensor([plan.slot[plan.leader[i]] for i in followers], device=self.device)
            dst = torch.tensor([plan.slot[i] for i in followers], device=self.device)
            for layer in self.cache.layers:
                layer.keys.index_copy_(0, dst, layer.keys.index_select(0, src))
                layer.values.index_copy_(0, dst, layer.values.index_select(0, src))
        for i, c in enumerate(contexts):
            self.cached[plan.slot[i]] = list(c)
        return torch.stack([logits[plan.leader[i]] for i in range(len(contexts))])

    def run(self, model: Any, contexts: list[list[int]], limits: list[int], warpers: Any, stop_ids: list[int],
            greedy: bool) -> list[tuple[list[int], list[float]]]:
        """Per context, the sampled ids (ending on a stop id or at its limit) and their log-probs."""
        try:
            return self._run(model, contexts, limits, warpers, stop_ids, greedy)
        except BaseException:
            self.forget()  # a call cut short leaves slots half written: none is trusted again
            raise

    def _run(self, model: Any, contexts: list[list[int]], limits: list[int], warpers: Any, stop_ids: list[int],
             greedy: bool) -> list[tuple[list[int], list[float]]]:
        plan = self.plan(contexts)
        n, steps = len(contexts), max(limits)
        logits = self.prefill(model, contexts, plan)
        slot_of = torch.tensor(plan.slot, dtype=torch.long, device=self.device)
        limit = torch.tensor(limits, dtype=torch.long, device=self.device)
        length = torch.tensor([len(c) for c in contexts], dtype=torch.long, device=self.device)  # next position
        longest = max(map(len, contexts))  # the longest slot of the call (host side: the eager window)
        stop = torch.tensor(stop_ids, dtype=torch.long, device=self.device)
        tokens = torch.zeros((n, steps), dtype=torch.long, device=self.device)
        logprobs = torch.zeros((n, steps), dtype=torch.float32, device=self.device)
        count = torch.zeros(n, dtype=torch.long, device=self.device)
        active = torch.ones(n, dtype=torch.bool, device=self.device)
        for k in range(steps):
            # generate's sampling step: float32 logits through the warpers; softmax + multinomial, or argmax
            scores = warpers(tokens[:, :k], logits.float())
            logp = torch.log_softmax(scores, dim=-1)
            tok = scores.argmax(-1) if greedy else torch.multinomial(torch.softmax(scores, dim=-1), 1)[:, 0]
            tokens[:, k] = tok
            logprobs[:, k] = logp.gather(1, tok[:, None])[:, 0]
            count += active.long()
            active &= ~(torch.isin(tok, stop) | (count >= limit))
            if k + 1 == steps or not bool(active.any()):
                break
            # feed the sampled ids of the slots still decoding at their next column; the rest to the trash
            self.ids[slot_of, 0] = tok
            self.cols.fill_(TRASH)
            self.cols[slot_of] = torch.where(active, length + 1, TRASH)
            length += active.long()
            longest += 1
            logits = self.decode(model, longest + 1).index_select(0, slot_of)
        counts = count.tolist()
        ids, lps = tokens.tolist(), logprobs.tolist()
        out = []
        for i, c in enumerate(contexts):
            got = ids[i][: counts[i]]
            self.cached[plan.slot[i]] = list(c) + got[:-1]  # every sampled id but the last went through the model
            out.append((got, lps[i][: counts[i]]))
        return out


def round_columns(n: int) -> int:
    """Columns for ``n`` tokens, rounded up (fewer reallocations, fewer graph captures)."""
    return -(-int(n) // COLUMN_ROUND) * COLUMN_ROUND


@contextlib.contextmanager
def supported_attention(model: Any) -> Iterator[None]:
    """The model on an attention implementation that takes a prepared 4D mask (sdpa, eager) while it
    samples: flash attention's kernels take padding masks only. Restored afterwards, as the paged
    backend restores its own."""
    original = model.config._attn_implementation
    if original in ATTENTION_SUPPORTED:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(original)


# ---------------------------------------------------------------- the backend's engine, sized for a call
def engine_for(engine: SlotEngine | None, model: Any, contexts: list[list[int]], limits: list[int],
               graphs: bool | None) -> SlotEngine:
    """The engine a call of ``generate.StaticGenerator`` runs on: ``engine`` when the call fits it,
    a grown copy when it does not, a new one for a first call or a model on another device.
    ``graphs``: capture the decode step (default: on CUDA devices; never on a CPU)."""
    device = next(model.parameters()).device
    if engine is not None and engine.device != device:
        engine = None  # the model moved: a new cache on its device
    if engine is None:
        need = max(len(c) + m for c, m in zip(contexts, limits, strict=True))
        use_graphs = device.type == "cuda" and (graphs is None or bool(graphs))
        return SlotEngine(model, len(contexts), round_columns(need) + 1, use_graphs)
    return engine if engine.fits(contexts, limits) else engine.grown(model, contexts, limits)
