"""lm-evaluation-harness's model interface over a longtrain model: the harness owns the tasks, prompts, few-shot
sampling and metrics; this class answers its three requests with a loaded decoder (either family) and the dataset's
SentencePiece tokenizer.

    from pipeline.eval.harness_model import LongtrainLM
    lm = LongtrainLM(engine.module.decoder, tokenizer, max_length=cfg.data.seq_len)
    lm_eval.simple_evaluate(model=lm, tasks=["builtin_cloze"], ...)     # pipeline/eval/harness_tasks.py does this

It subclasses the harness's TemplateLM, so a (context, continuation) pair is tokenized exactly as the harness's own
Hugging Face backend tokenizes it (the context encoded alone, the continuation as the rest of the whole's encoding;
an empty context is the EOS token, which ends every document in the shards). Its answers:

- loglikelihood: sum of log p(continuation | context) and whether greedy decoding gives the continuation. The
  requests are grouped by their (truncated) context: a context several requests share runs once through the model
  into a KV cache (a recurrent state for the resonance family), which is then copied to one row per continuation
  (model/kv_cache.py select_rows), so the k choices of a question cost one context forward instead of k; a context
  nobody shares runs with its continuation in one plain causal forward. Both are batched by length, longest first,
  up to `batch_tokens` tokens per forward.
- loglikelihood_rolling (perplexity tasks): the harness's own rolling windows of max_length tokens, scored as above.
- generate_until: greedy decoding (model/decode_loop.py) until a stop string, the EOS token or max_gen_toks.

Long inputs are truncated from the left to the model's length as the Hugging Face backend does: context and
continuation together keep their last max_length + 1 tokens (the first of them is only conditioned on), and a
generation prompt its last max_length - max_gen_toks. Scores are computed in fp32 from the hidden states and the
output projection (the model's logits, (tokens, vocab), only for the scored positions).
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable

import torch
import torch.nn.functional as F

from pipeline.eval.harness_tasks import offline

offline()  # before the harness imports huggingface_hub and datasets, which read it once
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval import utils as harness_utils  # noqa: E402

DEFAULT_BATCH_TOKENS = 8192  # context tokens per forward (and continuation tokens per forward over the copies)


class LongtrainLM(TemplateLM):
    """The harness's model over `decoder` (model/decoder.py Decoder or model/resonance.py ResonanceLM, weights
    loaded, on its device) and `tokenizer` (pipeline/data/tokenizer.py Tokenizer). `max_length`: the longest input
    in tokens (the trained row length). `on_batch(n)`: called after each forward with the requests it finished."""

    def __init__(self, decoder: torch.nn.Module, tokenizer: Any, max_length: int, *,
                 batch_tokens: int = DEFAULT_BATCH_TOKENS, max_gen_toks: int = 256,
                 on_batch: Callable[[int], None] | None = None):
        super().__init__()
        self.decoder = decoder.eval()
        self.sp = tokenizer
        self._max_length = int(max_length)
        self.batch_tokens = max(int(batch_tokens), self._max_length + 1)
        self.max_gen_toks = max_gen_toks
        self.on_batch = on_batch
        self.forwards = 0  # model forwards run (contexts and continuation chunks): the sharing's effect, for tests
        self.context_tokens = 0  # context tokens run through the model

    # ------------------------------------------------------------------------------------------ the interface
    @property
    def eot_token_id(self) -> int:
        return self.sp.eos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def device(self) -> torch.device:
        return self.decoder.output_weight.device

    @property
    def tokenizer_name(self) -> str:
        return f"sentencepiece-{self.sp.sha256[:12]}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """The SentencePiece ids of `string`, no BOS (documents in the shards start without one)."""
        return self.sp.encode(string)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.sp.decode(tokens)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=True)  # the harness's tokenizing bar: noise per task

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of log p over each whole string, in the harness's rolling windows of max_length tokens."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owner: list[int] = []
        for i, (string,) in enumerate(req.args for req in requests):
            rolling = harness_utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                              prefix_token=self.prefix_token_id,
                                                              max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(harness_utils.make_disjoint_window, rolling):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows)):
            totals[i] += logprob
        return totals

    def _loglikelihood_tokens(self, requests: list[tuple[Any, list[int], list[int]]],
                              disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """[(request, context ids, continuation ids)] -> [(sum of log p(continuation), greedy)] in request order."""
        groups: dict[tuple[int, ...], list[tuple[int, list[int]]]] = defaultdict(list)
        for i, (_, context, continuation) in enumerate(requests):
            if not continuation:
                raise ValueError("the harness asked for the likelihood of an empty continuation")
            if len(continuation) > self.max_length:
                continuation = continuation[-self.max_length:]  # only the last max_length are predicted
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]  # as the HF backend truncates
            groups[tuple(whole[:len(whole) - len(continuation)])].append((i, continuation))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        shared = [g for g in groups.items() if len(g[1]) > 1]
        alone = sorted(((i, list(ctx), cont) for ctx, members in groups.items() if len(members) == 1
                        for i, cont in members), key=lambda r: -(len(r[1]) + len(r[2])))
        for batch in self._batches(sorted(shared, key=lambda g: -(len(g[0]) + max(map(len, (
                c for _, c in g[1])))))):
            for i, scored in self._score_batch(batch):
                results[i] = scored
            if self.on_batch is not None:
                self.on_batch(sum(len(g[1]) for g in batch))
        start = 0
        while start < len(alone):  # a context no other request shares: one plain forward, as the HF backend runs
            rows = max(1, self.batch_tokens // (len(alone[start][1]) + len(alone[start][2])))
            for i, scored in self._score_alone(alone[start:start + rows]):
                results[i] = scored
            if self.on_batch is not None:
                self.on_batch(len(alone[start:start + rows]))
            start += rows
        return results  # type: ignore[return-value]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations of each context, cut at the first of its `until` strings (and at EOS)."""
        from model.decode_loop import generate_ids

        out: list[str | None] = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            by_kwargs[repr(sorted(req.args[1].items()))].append(i)
        for indices in by_kwargs.values():
            kwargs = dict(requests[indices[0]].args[1])
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            new_tokens = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            keep = max(1, self.max_length - new_tokens)
            prompts = {i: (self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-keep:] for i in indices}
            order = sorted(indices, key=lambda i: -len(prompts[i]))
            rows = max(1, self.batch_tokens // (keep + new_tokens))
            for start in range(0, len(order), rows):
                chunk = order[start:start + rows]
                with torch.no_grad():
                    ids = generate_ids(self.decoder, [prompts[i] for i in chunk], max_new_tokens=new_tokens,
                                       temperature=0.0, eos_id=self.eot_token_id, pad_id=self.eot_token_id)
                for i, row in zip(chunk, ids.tolist()):
                    if self.eot_token_id in row:
                        row = row[:row.index(self.eot_token_id)]
                    text = self.tok_decode(row)
                    for stop in until:
                        if stop and stop in text:
                            text = text[:text.index(stop)]
                    out[i] = text
                if self.on_batch is not None:
                    self.on_batch(len(chunk))
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------------------------------ scoring
    def _batches(self, groups: list[tuple[tuple[int, ...], list[tuple[int, list[int]]]]]):
        """Consecutive groups (sorted longest first) whose contexts and continuations each fit batch_tokens."""
        batch: list = []
        ctx_len = cont_len = rows = 0
        for group in groups:
            c = len(group[0])
            m = max(len(cont) for _, cont in group[1])
            n = len(group[1])
            if batch and (max(ctx_len, c) * (len(batch) + 1) > self.batch_tokens
                          or max(cont_len, m) * (rows + n) > self.batch_tokens):
                yield batch
                batch, ctx_len, cont_len, rows = [], 0, 0, 0
            batch.append(group)
            ctx_len, cont_len, rows = max(ctx_len, c), max(cont_len, m), rows + n
        if batch:
            yield batch

    @torch.no_grad()
    def _score_batch(self, batch) -> list[tuple[int, tuple[float, bool]]]:
        """One forward over the batch's contexts (left-padded into a cache), one over every continuation (right-
        padded) on a copy of its context's cache: [(request index, (log p, greedy))]."""
        device, pad_id = self.device, self.eot_token_id
        contexts = [list(ctx) for ctx, _ in batch]
        longest = max(map(len, contexts))
        pads = [longest - len(c) for c in contexts]
        idx = torch.tensor([[pad_id] * p + c for p, c in zip(pads, contexts)], dtype=torch.long, device=device)
        rows = [(g, i, cont) for g, (_, members) in enumerate(batch) for i, cont in members]
        cont_len = max(len(cont) for _, _, cont in rows)
        left_pad = torch.tensor(pads, dtype=torch.long, device=device) if any(pads) else None
        cache = self.decoder.new_kv_cache(len(batch), longest + cont_len, left_pad)
        last = self.decoder(idx, kv_cache=cache)[:, -1]  # (G, D): predicts each continuation's first token
        self.forwards += 1
        self.context_tokens += sum(map(len, contexts))
        owner = torch.tensor([g for g, _, _ in rows], dtype=torch.long, device=device)
        hidden = last.index_select(0, owner)[:, None]  # (R, 1, D)
        if cont_len > 1:  # the continuations' own tokens but the last, after a copy of their context's cache
            chunk = torch.tensor([cont[:-1] + [pad_id] * (cont_len - len(cont)) for _, _, cont in rows],
                                 dtype=torch.long, device=device)  # (R, cont_len - 1)
            hidden = torch.cat([hidden, self.decoder(chunk, kv_cache=cache.select_rows(owner))], dim=1)
            self.forwards += 1
        return self._scores([i for _, i, _ in rows], hidden, [cont for _, _, cont in rows])

    @torch.no_grad()
    def _score_alone(self, items: list[tuple[int, list[int], list[int]]]) -> list[tuple[int, tuple[float, bool]]]:
        """[(request index, context, continuation)] whose contexts nobody shares: context + continuation but its
        last token, right-padded, in one causal forward without a cache."""
        device, pad_id = self.device, self.eot_token_id
        inputs = [(ctx + cont)[:-1] for _, ctx, cont in items]
        width = max(map(len, inputs))
        idx = torch.tensor([x + [pad_id] * (width - len(x)) for x in inputs], dtype=torch.long, device=device)
        hidden = self.decoder(idx)  # (B, width, D)
        self.forwards += 1
        self.context_tokens += sum(len(ctx) for _, ctx, _ in items)
        cont_len = max(len(cont) for _, _, cont in items)
        # row b's continuation is predicted at positions len(ctx) - 1 .. len(ctx) + len(cont) - 2
        where = torch.tensor([[min(len(ctx) - 1 + j, width - 1) for j in range(cont_len)] for _, ctx, _ in items],
                             dtype=torch.long, device=device)  # (B, cont_len)
        hidden = hidden.gather(1, where[..., None].expand(-1, -1, hidden.shape[-1]))
        return self._scores([i for i, _, _ in items], hidden, [cont for _, _, cont in items])

    def _scores(self, owners: list[int], hidden: torch.Tensor, conts: list[list[int]]):
        """hidden (R, C, D): the states that predict each continuation's tokens (right-padded to C) ->
        [(request index, (sum of log p, greedy))], in fp32."""
        device, cont_len = hidden.device, hidden.shape[1]
        lengths = torch.tensor([len(c) for c in conts], device=device)
        target = torch.tensor([c + [self.eot_token_id] * (cont_len - len(c)) for c in conts], dtype=torch.long,
                              device=device)  # (R, C)
        logits = F.linear(hidden.float(), self.decoder.output_weight.float())  # (R, C, V)
        scored = torch.arange(cont_len, device=device)[None] < lengths[:, None]  # (R, C): not a pad
        logprob = F.log_softmax(logits, dim=-1).gather(2, target[..., None])[..., 0].masked_fill(~scored, 0.0)
        hit = (logits.argmax(dim=-1) == target) | ~scored
        return [(i, (float(lp), bool(g))) for i, lp, g in zip(owners, logprob.sum(1).tolist(), hit.all(1).tolist())]
