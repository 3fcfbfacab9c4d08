"""Log-probabilities from the exact model: the API's ``logprobs`` and ``echo``.

Eval harnesses score text by its tokens' log-probabilities: lm-eval's loglikelihood tasks
(multiple choice) send context + continuation with ``echo`` and ``logprobs`` and read the
continuation's sum and whether each of its tokens was the argmax. The engines cannot answer
that: their captured graphs end in an argmax or a sampler and hand back tokens, and verified
mode's drafts are FP8's. So a request for log-probabilities runs on the exact model's own
forward, eager, the BF16 reference the engines are held to (``reference.exact_greedy_tokens``
takes the same steps): the prompt in chunks, then one token at a time. Slower than the
engines; exact by construction, in every mode.

Reported log-probabilities are the model's own (log-softmax of its logits, before temperature
or top-k / top-p), as vLLM reports them; a sampled reply draws from the warped distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .detokenize import IncrementalDetokenizer
from .errors import RequestError
from .penalties import PenaltySettings, penalize
from .sampling import SamplingParams, sample_from_logits

MAX_TOP = 20  # alternatives per position (OpenAI's chat API allows 20)
# Logits held at once while scoring a prompt: (tokens, vocab) float32 rows. 256 MiB is ~270
# tokens of a 248k vocabulary, a whole 4k prompt of the demo model's 4096.
LOGIT_BYTES = 256 * 2**20


@dataclass(frozen=True)
class LogprobsRequest:
    """What a request asks for: ``top`` alternatives per position (0..MAX_TOP), every prompt
    token's entry as well (``prompt``, the API's echo), and whether to generate at all (an
    echo with max_tokens 0 only scores its prompt)."""

    top: int = 0
    prompt: bool = False
    generate: bool = True

    def __post_init__(self) -> None:
        if not (isinstance(self.top, int) and not isinstance(self.top, bool)
                and 0 <= self.top <= MAX_TOP):
            raise RequestError(f"top_logprobs has the value {self.top!r}; allowed: an "
                               f"integer in 0..{MAX_TOP}")
        if not self.generate and not self.prompt:
            raise RequestError("max_tokens 0 returns nothing unless the prompt is scored too "
                               "(echo); ask for at least one token")


@dataclass
class TokenLogprob:
    token: int
    logprob: float | None  # None: the prompt's first token, which nothing predicts
    top: list[tuple[int, float]] = field(default_factory=list)  # most likely first


def rows_logprobs(logits: torch.Tensor, targets: torch.Tensor, top: int) -> list[TokenLogprob]:
    """logits (T, V), each row predicting the token at the same index of targets (T,): each
    target's log-probability and the ``top`` most likely tokens, one host transfer."""
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(-1, targets[:, None])[:, 0].tolist()
    ids = targets.tolist()
    if not top:
        return [TokenLogprob(t, lp) for t, lp in zip(ids, chosen, strict=True)]
    values, indices = logp.topk(top, dim=-1)
    return [TokenLogprob(t, lp, list(zip(i, v, strict=True)))
            for t, lp, i, v in zip(ids, chosen, indices.tolist(), values.tolist(), strict=True)]


def score_chunk(vocab: int, limit: int) -> int:
    """Prompt tokens per forward while scoring: as many as LOGIT_BYTES holds, at most
    ``limit`` (the preset's prefill chunk)."""
    return max(1, min(limit, LOGIT_BYTES // (4 * vocab)))


@torch.inference_mode()
def prefill(model, cache, ids: torch.Tensor, top: int | None, chunk: int
            ) -> tuple[list[TokenLogprob], torch.Tensor]:
    """Fold ``ids`` (1, T) into ``cache``; return the logits (V,) for the next token and, when
    ``top`` is not None, every prompt token's entry (the first without a log-probability),
    from chunks of ``chunk`` tokens so that only one chunk's logits are held."""
    entries: list[TokenLogprob] = []
    if top is not None:
        entries.append(TokenLogprob(int(ids[0, 0]), None))
    last = None
    for start in range(0, ids.shape[1], chunk):
        piece = ids[:, start:start + chunk]
        logits = model(input_ids=piece, past_key_values=cache, use_cache=True,
                       logits_to_keep=0 if top is not None else 1).logits[0]
        if top is not None:
            # the rows predicting this chunk's tokens: the last chunk's final row, then this
            # chunk's rows but its last
            rows = logits[:-1] if last is None else torch.cat([last[None], logits[:-1]])
            targets = piece[0, 1:] if last is None else piece[0]
            entries += rows_logprobs(rows, targets, top)
        last = logits[-1]
    return entries, last


@torch.inference_mode()
def generate(model, cache, logits: torch.Tensor, max_new: int, top: int, *,
             stop_ids=(), sampling: SamplingParams | None = None,
             generator: torch.Generator | None = None,
             on_token: Callable[[TokenLogprob], bool] | None = None,
             constraint=None, penalties: PenaltySettings | None = None,
             prompt: list[int] | None = None) -> tuple[list[TokenLogprob], str]:
    """Up to ``max_new`` tokens after a prefill whose next-token logits are ``logits`` (V,),
    each with its log-probability and ``top`` alternatives. Greedy, or sampled as the
    engines sample (``sample_from_logits``, uniforms from ``generator``). A stop id ends the
    reply and is not returned; ``on_token`` returning False cancels. Returns the entries and
    how it stopped: "stop", "length" or "cancelled". ``constraint``: a
    ``structured.Constraint`` that masks each step's choice to its grammar and takes each
    token chosen (the entries stay the model's own log-probabilities). ``penalties``: each
    choice from the penalized logits (unimax.penalties; ``prompt``: the prompt's ids, which the
    repetition penalty counts), the entries still the model's own."""
    sampling = sampling or SamplingParams()
    stops = {int(s) for s in stop_ids}
    device = logits.device
    if penalties is not None and penalties.active:
        counts = torch.zeros(1, logits.shape[-1], device=device)
        in_prompt = torch.zeros(logits.shape[-1], dtype=torch.bool, device=device)
        in_prompt[torch.tensor(prompt or [], dtype=torch.long, device=device)] = True
        weights = torch.tensor([penalties.presence, penalties.frequency, penalties.repetition],
                               device=device)
    else:
        counts = None
    if not sampling.is_greedy:
        temperature = torch.tensor([sampling.temperature], device=device)
        top_k = torch.tensor([sampling.top_k], device=device)
        top_p = torch.tensor([sampling.top_p], device=device)
        min_p = torch.tensor([sampling.min_p], device=device)
    entries: list[TokenLogprob] = []
    for step in range(max_new):
        scores = logits if counts is None else penalize(logits[None], counts, in_prompt,
                                                        weights)[0]
        scores = scores if constraint is None else constraint.masked(scores)
        if sampling.is_greedy:
            token = scores.argmax().view(1, 1)
        else:
            uniform = torch.rand(1, generator=generator).to(device)
            token = sample_from_logits(scores[None], temperature, top_k, top_p, uniform, min_p)
        if constraint is not None:
            constraint.accept(int(token))
        if int(token) in stops:
            return entries, "stop"
        if counts is not None:
            counts[0, int(token)] += 1
        entry = rows_logprobs(logits[None], token[0], top)[0]
        entries.append(entry)
        if on_token is not None and not on_token(entry):
            return entries, "cancelled"
        if step + 1 < max_new:
            logits = model(input_ids=token, past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits[0, -1]
    return entries, "length"


def token_texts(tokenizer, tokens: list[int], previous: int | None) -> list[str]:
    """Each token's text as it reads after ``previous`` (SentencePiece drops a word's leading
    space when a token is decoded alone; byte-level pieces of one character decode to the
    replacement character, as OpenAI's tokens do)."""
    def alone(token: int) -> str:
        return tokenizer.decode([token], skip_special_tokens=False)

    if previous is None:
        return [alone(t) for t in tokens]
    before = alone(previous)  # once for the token and all its alternatives
    texts = []
    for token in tokens:
        both = tokenizer.decode([previous, token], skip_special_tokens=False)
        texts.append(both[len(before):] if both.startswith(before) else alone(token))
    return texts


class EntryText:
    """Entries as the API shows them: each token's text as it reads in context, its
    alternatives' likewise, and its offset into the text streamed so far (an
    IncrementalDetokenizer's: a token that ends inside a character has no text of its own yet,
    and the one that completes it carries it)."""

    def __init__(self, tokenizer, previous: int | None = None, continues: bool = False):
        """``continues``: the text goes on from ``previous``'s (a raw prompt's completion, whose
        first word keeps its leading space)."""
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, previous if continues else None)
        self.previous = previous

    def add(self, entry: TokenLogprob) -> tuple[dict, str]:
        """The entry as a dict (token, text, logprob, top: [[text, logprob], ...], offset) and
        the text it adds to the stream."""
        offset = len(self.detok.text)
        delta = self.detok.add([entry.token])
        text, *alternatives = token_texts(self.tokenizer,
                                          [entry.token] + [t for t, _ in entry.top],
                                          self.previous)
        item = {"token": entry.token, "offset": offset, "logprob": entry.logprob,
                "text": text, "top": [[alt, lp] for alt, (_, lp) in
                                      zip(alternatives, entry.top, strict=True)]}
        self.previous = entry.token
        return item, delta

    def flush(self) -> str:
        return self.detok.flush()

    @property
    def text(self) -> str:
        return self.detok.text
