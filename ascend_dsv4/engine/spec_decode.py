"""MTP speculative decoding (one draft token per step from the model's MTP module, DeepSeek-V4 and V3).

A step with speculation, for a decoding request whose last sampled token is x_{p+1} and whose draft is d:

1. the main model runs [x_{p+1}, d] at positions p+1, p+2 (one ragged batch with everything else);
2. verification: the token after x_{p+1} is sampled from the main logits at p+1 exactly as without
   speculation; greedy: d is accepted iff it equals that argmax; otherwise rejection sampling accepts d with
   probability min(1, p(d) / q(d)) and on rejection draws from normalise(max(p - q, 0)) — the output
   distribution is exactly the main model's. With d accepted, a bonus token is sampled from the logits at p+2;
3. rollback: the sequence keeps the KV of the accepted positions only (``num_tokens`` is set back); window
   rows, compressor state rows and compressed entries are addressed by position, so the rejected position
   is simply rewritten later (an entry completed by a rejected token is recomputed when its true last token
   arrives);
4. MTP catch-up: the MTP module runs over every position committed in this step (main hidden states at t,
   true token t+1), which keeps its own window KV exact and yields the next draft from its last position.

Greedy outputs are therefore identical with and without speculation.
"""

from __future__ import annotations

import torch

from ..errors import RequestFailed
from ..kv.blocks import SeqBlocks
from .sampling import Sampler


def speculation_problem(num_speculative_tokens, has_mtp: bool) -> str | None:
    """Why ``num_speculative_tokens`` cannot run on a model (``has_mtp``: it has an MTP module), or None. The
    engine raises it as a RequestError; the data-parallel front end as a ConfigError before any worker starts."""
    if num_speculative_tokens not in (0, 1):
        return f"num_speculative_tokens must be 0 or 1 (one MTP draft per step), got {num_speculative_tokens!r}"
    if num_speculative_tokens and not has_mtp:
        return "speculative decoding needs a model with an MTP module"
    return None


def rejection_accept(p: torch.Tensor, q: torch.Tensor, draft: int, gen: torch.Generator | None) -> tuple[bool, int]:
    """Speculative-sampling acceptance for one draft token.

    p: target distribution [V]; q: draft distribution [V] (the draft was drawn from q). Returns
    (accepted, token): token == draft when accepted, else a draw from normalise(max(p - q, 0)).
    """
    pd, qd = float(p[draft]), float(q[draft])
    u = float(torch.rand((), generator=gen)) if gen is not None else float(torch.rand(()))
    if qd > 0 and u < min(1.0, pd / qd):
        return True, draft
    resid = (p - q).clamp(min=0)
    if float(resid.sum()) <= 0:
        resid = p
    tok = int(torch.multinomial(resid / resid.sum(), 1, generator=gen)[0])
    return False, tok


class MTPDrafter:
    """Runs the MTP module over committed positions and proposes the next draft token of each request."""

    def __init__(self, runner, sampler: Sampler):
        self.runner, self.sampler = runner, sampler

    def catch_up(self, items: list[tuple], streams) -> list[tuple[int, torch.Tensor] | None]:
        """items: (request, start position, committed count, rows [n] of the step's hidden states ``streams``,
        the handle :meth:`ModelRunner.execute` returned) for each request.

        Runs MTP on positions start .. start+n-1 with next tokens all_ids[pos + 1] (all known: the token after
        the last committed position was just sampled). Returns per item (draft token, draft distribution)
        or None (finished requests pass count 0)."""
        live = [(r, s, n, rows) for r, s, n, rows in items if n > 0]
        if not live:
            return [None] * len(items)
        views = [SeqBlocks(r.seq.token, r.seq.c4, r.seq.c128, s) for r, s, n, _ in live]
        next_ids = [r.all_ids[s + 1 + i] for r, s, n, _ in live for i in range(n)]
        rows = torch.cat([rows for _, _, _, rows in live])
        # left where they were computed (on a data-parallel replica's rank): only the greedy picks, the bad rows
        # and the sampled requests' rows travel
        sampled = [i for i, (r, *_rest) in enumerate(live) if not r.params.greedy]
        out = self.runner.draft_rows(views, [n for _, _, n, _ in live], next_ids, streams, rows, sampled)
        bad, picks, kept = set(out.bad_rows), out.row_argmax, {j: x for x, j in enumerate(out.kept)}
        drafts = []
        for i, (r, *_rest) in enumerate(live):
            if i in bad:  # non-finite MTP logits: no draft this step (the request itself goes on)
                drafts.append(None)
            elif r.params.greedy:  # greedy verification compares tokens: no distribution needed
                drafts.append((picks[i], None))
            else:
                try:
                    q = self.sampler.probs(out.logits[kept[i]:kept[i] + 1], [r.params])[0]
                except RequestFailed:  # the draft overflowed after temperature: propose nothing
                    drafts.append(None)
                    continue
                drafts.append((int(torch.multinomial(q, 1, generator=r.generator)[0]), q))
        it = iter(drafts)
        return [next(it) if n > 0 else None for _r, _s, n, _rows in items]
