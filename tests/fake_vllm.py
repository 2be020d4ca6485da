"""A faithful CPU stand-in for vLLM, for driving TRL 1.16's own vLLM integration in tests.

vLLM ships CUDA-only wheels, so TRL's ``VLLMGeneration`` cannot build a real engine here. What is
replaced is only what TRL would import from vLLM; everything TRL does around it (the weight sync
with its PEFT merge, the ``VLLMClient`` HTTP calls and their parsing, the importance-sampling
tensors) runs as shipped:

- ``FakeEngine``: the engine. It owns a model of the trained architecture, in the engine's dtype
  (``dtype``, vLLM's ``--dtype``: bf16 for a bf16 checkpoint), whose weights start as NaN, so it can
  only answer with the weights a sync loaded (``load_weights``, vLLM's loader API, HF parameter
  names, each tensor cast to the engine's dtype as vLLM's loader copies it). It samples as vLLM's v1 sampler does: logits / temperature, then vLLM's
  ``apply_top_k_top_p`` (top_k 0 or -1 = off), the exponential-race draw of ``random_sample``;
  ``logprobs_mode="processed_logprobs"`` returns the log-softmax of the processed logits, the
  sampled token's logprob (and its rank) per position; a request stops on a ``stop_token_ids``
  id or the model's eos ids (kept in ``token_ids``, ``finish_reason="stop"``), on ``max_tokens``
  or on ``max_model_len`` (``"length"``); ``n`` samples per prompt.
- ``fake_llm_class(engine_factory)``: a ``vllm.LLM`` for colocate mode (``LLM.generate`` with
  ``{"prompt_token_ids": ...}`` prompts and ``SamplingParams``, ``RequestOutput``-shaped answers,
  ``llm_engine.model_executor.driver_worker.model_runner.model.load_weights``).
- ``FakeServer`` + ``FakeAdapter``: ``vllm serve`` behind a ``requests`` transport adapter, so
  TRL's real ``VLLMClient`` builds its requests, posts them through a real ``requests.Session``
  and parses the JSON answers (``/v1/completions`` with ``return_token_ids`` and
  ``return_tokens_as_token_ids``, ``/server_info``, the weight-transfer endpoints).
- ``FakeWire``: NCCL's weight broadcast. TRL's client announces (name, dtype, shape) in the
  ``/update_weights`` request and then broadcasts the bare tensors in that order; the fake server
  reads them off the wire in the announced order, as vLLM's receiving workers do.

``events`` (a list shared by everything built from one ``Recorder``) keeps the order of syncs,
prefix-cache resets and engine calls, which is what the trainer tests assert on.
"""

from __future__ import annotations

import copy
import json
import queue
import types
from dataclasses import dataclass, field
from typing import Any

import torch

SAMPLING_EPS = 1e-5  # vLLM treats temperature below this as greedy


@dataclass
class Recorder:
    events: list[tuple] = field(default_factory=list)  # ("sync", {name: tensor}) | ("generate", prompts, params) | ...
    syncs: list[dict[str, torch.Tensor]] = field(default_factory=list)
    generate_calls: list[dict] = field(default_factory=list)
    # keep a CPU copy of the tensors of only the last N syncs (0: none; None: every sync). A benchmark's
    # thousand cycles at the 7B shape cannot hold ~15 GB a sync; the engine's own weights stay checkable.
    keep_syncs: int | None = None


# vllm.SamplingParams' defaults, for the fields TRL and musique_rl set
SAMPLING_DEFAULTS = {"n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                     "presence_penalty": 0.0, "frequency_penalty": 0.0, "max_tokens": 16, "logprobs": None,
                     "stop_token_ids": None, "skip_special_tokens": True, "ignore_eos": False, "seed": None,
                     "prompt_logprobs": None}


class SamplingParams(types.SimpleNamespace):
    """vllm.SamplingParams, the fields TRL and musique_rl set (vLLM's defaults); any other is a
    TypeError, as a keyword the real class lacks would be."""

    def __init__(self, **fields: Any):
        unknown = sorted(set(fields) - set(SAMPLING_DEFAULTS))
        if unknown:
            raise TypeError(f"SamplingParams got unexpected keyword arguments {unknown}")
        super().__init__(**{**SAMPLING_DEFAULTS, **fields})


def fake_vllm_module() -> types.ModuleType:
    """What ``from vllm import SamplingParams`` needs (musique_rl's colocate generator imports it)."""
    module = types.ModuleType("vllm")
    module.SamplingParams = SamplingParams
    return module


# ---------------------------------------------------------------- vLLM's sampler
def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """vLLM v1's ``vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p`` (sort ascending,
    mask below the k-th largest, then the low tail whose cumulative probability is <= 1 - p,
    always keeping the top token). Written out because it is the behaviour being imitated."""
    if k is None and p is None:
        return logits
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        top_k_mask = logits_sort.size(1) - k.to(torch.long)
        top_k_mask = logits_sort.gather(1, top_k_mask.unsqueeze(dim=1))
        logits_sort.masked_fill_(logits_sort < top_k_mask, -float("inf"))
    if p is not None:
        probs_sort = logits_sort.softmax(dim=-1)
        probs_sum = torch.cumsum(probs_sort, dim=-1)
        top_p_mask = probs_sum <= 1 - p.unsqueeze(dim=1)
        top_p_mask[:, -1] = False
        logits_sort.masked_fill_(top_p_mask, -float("inf"))
    return logits_sort.scatter(dim=-1, index=logits_idx, src=logits_sort)


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(1, vocab) raw logits -> the distribution vLLM samples from (temperature, top-k, top-p).
    The penalties and min_p are not imitated: a request that sets them (the trainer would not apply
    them either) fails here instead of being sampled as if they were neutral."""
    penalties = (params.min_p, params.repetition_penalty, params.presence_penalty, params.frequency_penalty)
    if penalties != (0.0, 1.0, 0.0, 0.0):
        raise NotImplementedError(f"the vLLM stand-in samples with neutral penalties only, got {penalties}")
    logits = logits.float()
    if params.temperature >= SAMPLING_EPS:
        logits = logits / params.temperature
    vocab = logits.shape[-1]
    k = None if params.top_k in (0, -1) else torch.tensor([min(int(params.top_k), vocab)])
    p = None if params.top_p >= 1.0 else torch.tensor([float(params.top_p)])
    return apply_top_k_top_p(logits, k, p)


# ---------------------------------------------------------------- the engine
class FakeEngine:
    """A model of the trained architecture, loaded only through syncs, sampled with vLLM's rules."""

    def __init__(self, config: Any, eos_ids: set[int], recorder: Recorder, *, max_model_len: int,
                 logprobs_mode: str = "processed_logprobs", dtype: torch.dtype | None = None,
                 device: str | torch.device = "cpu"):
        from transformers import AutoModelForCausalLM

        # ``dtype``: the engine's own (vLLM's ``--dtype``; a bf16 checkpoint's config gives bf16). The
        # weights a sync sends are cast to it on load, as vLLM's ``default_weight_loader`` copies them.
        # ``device``: where its weights live (a GPU benchmark's engine sits on the trainer's card).
        with torch.device(device):
            self.model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=dtype).eval()
        with torch.no_grad():
            for p in self.model.parameters():
                p.fill_(float("nan"))  # an engine nobody synced answers NaN log-probs
        self.params = dict(self.model.named_parameters())
        self.eos_ids = set(eos_ids)
        self.recorder = recorder
        self.max_model_len = int(max_model_len)
        self.logprobs_mode = logprobs_mode
        self._open_sync: dict[str, torch.Tensor] | None = None

    # -- weights (vLLM's model.load_weights: an iterable of (HF name, tensor))
    def load_weights(self, weights) -> None:
        keep = self.recorder.keep_syncs
        if self._open_sync is None:  # colocate: TRL calls load_weights once per tensor of one sync
            self._open_sync = {}
            self.recorder.syncs.append(self._open_sync)
            self.recorder.events.append(("sync", self._open_sync))
            if keep:  # older syncs keep their place in the lists, not their tensors
                for old in self.recorder.syncs[:-keep]:
                    old.clear()
        for name, tensor in weights:
            if name not in self.params:
                raise KeyError(f"vLLM has no parameter {name!r} (TRL must strip PEFT names and skip adapters)")
            target = self.params[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: shape {tuple(tensor.shape)} != the engine's {tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(tensor.detach().to(target.dtype))
            if keep != 0:
                self._open_sync[name] = tensor.detach().clone().cpu()

    def reset_prefix_cache(self) -> None:
        """Ends a sync (TRL resets the prefix cache after loading every tensor)."""
        self._open_sync = None
        self.recorder.events.append(("reset_prefix_cache",))

    # -- generation
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[dict]]:
        """Per prompt, ``params.n`` samples: dicts of token_ids, logprobs ([{id: (logprob, rank)}] or
        None), finish_reason. One call = one batch the engine scheduled."""
        self.recorder.generate_calls.append({"prompts": [list(p) for p in prompts], "params": params})
        self.recorder.events.append(("generate", len(prompts)))
        stop = set(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop |= self.eos_ids
        out = []
        for prompt in prompts:
            if len(prompt) >= self.max_model_len:
                raise ValueError(
                    f"The decoder prompt (length {len(prompt)}) is longer than the maximum model length of "
                    f"{self.max_model_len}."
                )
            samples = [self._sample_one(list(prompt), params, stop) for _ in range(int(params.n))]
            if params.prompt_logprobs is not None:
                scored = self._prompt_logprobs(list(prompt), int(params.prompt_logprobs))
                for sample in samples:
                    sample["prompt_logprobs"] = scored
            out.append(samples)
        return out

    @torch.no_grad()
    def _prompt_logprobs(self, prompt: list[int], top: int) -> list[dict | None]:
        """vLLM's ``prompt_logprobs``: per prompt position (None at the first) the prompt token's own
        log-prob and rank, plus the ``top`` most likely; from the RAW logits whatever the temperature or
        logprobs_mode (vLLM applies neither to prompt log-probs)."""
        lps = torch.log_softmax(self.model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
        out: list[dict | None] = [None]
        for pos in range(1, len(prompt)):
            row, token = lps[pos - 1], prompt[pos]
            entry = {token: (float(row[token]), int((row > row[token]).sum()) + 1)}
            if top > 0:
                values, ids = torch.topk(row, top)
                for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), 1):
                    entry.setdefault(int(t), (float(v), rank))
            out.append(entry)
        return out

    @torch.no_grad()
    def _sample_one(self, prompt: list[int], params: SamplingParams, stop: set[int]) -> dict:
        ids: list[int] = []
        logprobs: list[dict] = []
        finish = "length"
        past = None
        feed = torch.tensor([prompt])
        limit = int(params.max_tokens) if params.max_tokens is not None else self.max_model_len
        while len(ids) < limit and len(prompt) + len(ids) < self.max_model_len:
            out = self.model(input_ids=feed, past_key_values=past, use_cache=True)
            past = out.past_key_values
            raw = out.logits[:, -1, :].float()
            processed = process_logits(raw.clone(), params)
            if params.temperature < SAMPLING_EPS:
                token = int(processed.argmax(dim=-1))
            else:  # vLLM's random_sample: argmax of probs / Exp(1) noise, a draw from probs
                probs = processed.softmax(dim=-1)
                q = torch.empty_like(probs).exponential_()
                token = int(probs.div(q).argmax(dim=-1))
            if params.logprobs is not None:
                scored = processed if self.logprobs_mode == "processed_logprobs" else raw
                lps = torch.log_softmax(scored, dim=-1)[0]
                lp = float(lps[token])
                entry = {token: (lp, int((lps > lps[token]).sum()) + 1)}
                if params.logprobs > 0:
                    top = torch.topk(lps, int(params.logprobs))
                    for rank, (v, t) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
                        entry.setdefault(int(t), (float(v), rank))
                logprobs.append(entry)
            ids.append(token)
            if token in stop:
                finish = "stop"
                break
            feed = torch.tensor([[token]])
        return {"token_ids": ids, "logprobs": logprobs if params.logprobs is not None else None, "finish_reason": finish}


# ---------------------------------------------------------------- colocate: vllm.LLM
def fake_llm_class(engine_factory, recorder: Recorder):
    """A ``vllm.LLM`` whose engine ``engine_factory(**llm_kwargs)`` builds (TRL passes the model
    path, memory share, max_model_len, logprobs_mode, ...; they are kept in ``recorder.events``)."""

    class LLM:
        def __init__(self, **kwargs):
            recorder.events.append(("init_llm", kwargs))
            self.engine = engine_factory(**kwargs)
            ns = types.SimpleNamespace
            self.llm_engine = ns(
                model_config=ns(max_model_len=self.engine.max_model_len),
                model_executor=ns(driver_worker=ns(model_runner=ns(model=ns(load_weights=self.engine.load_weights)))),
            )

        def reset_prefix_cache(self) -> bool:
            self.engine.reset_prefix_cache()
            return True

        def generate(self, prompts, sampling_params=None, use_tqdm=True):
            ids = [p["prompt_token_ids"] for p in prompts]
            results = self.engine.generate(ids, sampling_params or SamplingParams())
            ns = types.SimpleNamespace
            def logprob_dicts(positions):
                return None if positions is None else [
                    None if pos is None else {t: ns(logprob=lp, rank=rank, decoded_token=None)
                                              for t, (lp, rank) in pos.items()}
                    for pos in positions
                ]

            return [
                ns(prompt_token_ids=p, prompt_logprobs=logprob_dicts(samples[0].get("prompt_logprobs")), outputs=[
                    ns(index=i, token_ids=s["token_ids"], finish_reason=s["finish_reason"],
                       logprobs=logprob_dicts(s["logprobs"]))
                    for i, s in enumerate(samples)
                ])
                for p, samples in zip(ids, results, strict=True)
            ]

    return LLM


# ---------------------------------------------------------------- server: vllm serve over HTTP
class FakeWire:
    """The NCCL group between the trainer (rank 0) and the server's workers: tensors only, in order."""

    def __init__(self):
        self.tensors: queue.Queue = queue.Queue()

    def send(self, tensor: torch.Tensor) -> None:
        # A broadcast copies the data when it is sent: a tensor that changes afterwards (PEFT unmerges
        # in place once the iteration ends) must not change what was received.
        self.tensors.put(tensor.detach().clone().cpu())


def fake_nccl_engine(wire_of):
    """Stand-ins for vLLM's ``NCCLWeightTransferEngine`` and ``NCCLTrainerSendWeightsArgs`` (the
    trainer side of the weight broadcast TRL's client uses)."""

    @dataclass
    class NCCLTrainerSendWeightsArgs:
        group: Any
        packed: bool = True

    class NCCLWeightTransferEngine:
        @staticmethod
        def trainer_send_weights(iterator, trainer_args):
            for _name, tensor in iterator:  # the broadcast carries tensors, never names
                trainer_args.group.send(tensor)

    return NCCLWeightTransferEngine, NCCLTrainerSendWeightsArgs


class FakeServer:
    """``VLLM_SERVER_DEV_MODE=1 vllm serve <model> --weight-transfer-config '{"backend": "nccl"}'
    --logprobs-mode processed_logprobs``: the endpoints TRL 1.16's ``VLLMClient`` calls."""

    def __init__(self, engine: FakeEngine, wire: FakeWire, model_name: str = "tiny", world_size: int = 1):
        self.engine, self.wire, self.model_name, self.world_size = engine, wire, model_name, world_size
        self.requests: list[tuple[str, str, Any]] = []
        self._updating = False

    def handle(self, method: str, path: str, body: Any) -> tuple[int, Any]:
        self.requests.append((method, path, body))
        e = self.engine
        if path == "/health":
            return 200, {}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.model_name, "object": "model"}]}
        if path == "/server_info":
            return 200, {"vllm_config": {
                "model_config": {"model": self.model_name, "max_model_len": e.max_model_len, "logprobs_mode": e.logprobs_mode},
                "weight_transfer_config": {"backend": "nccl"},
            }}
        if path == "/get_world_size":
            return 200, {"world_size": self.world_size}
        if path == "/init_weight_transfer_engine":
            return 200, {}
        if path == "/start_weight_update":
            self._updating = True
            return 200, {}
        if path == "/update_weights":
            if not self._updating:
                return 400, {"error": "update_weights outside start_weight_update/finish_weight_update"}
            info = body["update_info"]
            received = [self.wire.tensors.get(timeout=60) for _ in info["names"]]
            for name, dtype, shape, tensor in zip(info["names"], info["dtype_names"], info["shapes"], received, strict=True):
                if str(tensor.dtype).removeprefix("torch.") != dtype or list(tensor.shape) != list(shape):
                    return 400, {"error": f"{name}: announced {dtype}{shape}, received {tensor.dtype}{list(tensor.shape)}"}
            e.load_weights(list(zip(info["names"], received, strict=True)))
            return 200, {}
        if path == "/finish_weight_update":
            self._updating = False
            return 200, {}
        if path == "/reset_prefix_cache":
            e.reset_prefix_cache()
            return 200, {"success": True}
        if path == "/v1/completions":
            return self._completions(body)
        return 404, {"detail": "Not Found"}

    def _completions(self, body: dict) -> tuple[int, Any]:
        prompts = body["prompt"]
        if prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        params = SamplingParams(**{k: v for k, v in body.items() if k in SAMPLING_DEFAULTS})
        for p in prompts:
            if params.max_tokens is not None and len(p) + params.max_tokens > self.engine.max_model_len:
                return 400, {"object": "error", "type": "BadRequestError", "code": 400, "message": (
                    f"This model's maximum context length is {self.engine.max_model_len} tokens. However, you requested "
                    f"{len(p) + params.max_tokens} tokens ({len(p)} in the messages, {params.max_tokens} in the completion)."
                )}
        results = self.engine.generate(prompts, params)
        choices = []
        for prompt, samples in zip(prompts, results, strict=True):  # prompt-major, as vLLM orders them
            for s in samples:
                choices.append({
                    "index": len(choices),
                    "text": "",
                    "token_ids": s["token_ids"] if body.get("return_token_ids") else None,
                    "prompt_token_ids": prompt if body.get("return_token_ids") else None,
                    "logprobs": None if s["logprobs"] is None else completion_logprobs(s, body),
                    "finish_reason": s["finish_reason"],
                    "stop_reason": s["token_ids"][-1] if s["finish_reason"] == "stop" else None,
                    # vLLM's JSON: {"<token id>": {"logprob", "rank", "decoded_token"}} per position, None first
                    "prompt_logprobs": None if s.get("prompt_logprobs") is None else [
                        None if pos is None else {str(t): {"logprob": lp, "rank": rank, "decoded_token": ""}
                                                  for t, (lp, rank) in pos.items()}
                        for pos in s["prompt_logprobs"]],
                })
        return 200, {"id": "cmpl-fake", "object": "text_completion", "model": self.model_name, "choices": choices,
                     "usage": {"prompt_tokens": sum(map(len, prompts)),
                               "completion_tokens": sum(len(c["token_ids"] or []) for c in choices)}}


def completion_logprobs(sample: dict, body: dict) -> dict:
    """OpenAI completions ``logprobs`` as vLLM fills them with ``return_tokens_as_token_ids``: token
    strings ``token_id:<id>``, -inf clamped to -9999.0."""
    name = (lambda t: f"token_id:{t}") if body.get("return_tokens_as_token_ids") else str
    tokens, token_logprobs, top = [], [], []
    for t, pos in zip(sample["token_ids"], sample["logprobs"], strict=True):
        tokens.append(name(t))
        token_logprobs.append(max(pos[t][0], -9999.0))
        top.append({name(tid): max(lp, -9999.0) for tid, (lp, _rank) in pos.items()})
    return {"text_offset": [0] * len(tokens), "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top}


class FakeAdapter:
    """A ``requests`` transport adapter answering from a FakeServer (or from a fixed table of
    recorded answers): TRL's client keeps its own ``requests.Session``, URL building and JSON."""

    def __init__(self, server: Any, *args, **kwargs):
        self.server = server

    def send(self, request, **kwargs):
        from urllib.parse import parse_qs, urlparse

        import requests

        url = urlparse(request.url)
        body = json.loads(request.body) if request.body else {k: v[0] for k, v in parse_qs(url.query).items()}
        status, payload = self.server.handle(request.method, url.path, body)
        response = requests.Response()
        response.status_code = status
        response._content = json.dumps(payload).encode()
        response.headers["Content-Type"] = "application/json"
        response.url = request.url
        response.request = request
        return response

    def close(self):
        pass


def patch_vllm_client(monkeypatch, server: Any) -> None:
    """Route TRL's ``VLLMClient`` HTTP calls to ``server``: its session's adapter, and the bare
    ``requests.get`` of its health check. vLLM being absent, its availability gate is raised for
    the client module only."""
    import requests
    import trl.generation.vllm_client as vc

    adapter = FakeAdapter(server)
    monkeypatch.setattr(vc, "is_vllm_available", lambda *a, **k: True)
    monkeypatch.setattr(vc, "HTTPAdapter", lambda *a, **k: adapter)

    def get(url, **kwargs):
        request = requests.Request("GET", url, **kwargs).prepare()
        return adapter.send(request)

    monkeypatch.setattr(vc, "requests", types.SimpleNamespace(
        get=get, Session=requests.Session, exceptions=requests.exceptions))
