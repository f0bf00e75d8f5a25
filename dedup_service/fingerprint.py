"""The request fingerprint: what makes two requests "the same" for idempotency and content dedup.

Included, because each changes the output a caller receives:
- the tenant: identical prompts of two tenants must never share work or results (isolation);
- the model name: another model gives other tokens;
- the prompt as token ids (not text): two texts that tokenize alike are the same request, and the model only
  ever sees ids;
- every sampling parameter (temperature, top_p, top_k, seed, max_tokens, ignore_eos, logprobs, ...), as
  the caller passes them: pass *effective* values (defaults applied, e.g. top_p 0 -> 1.0) so that two
  requests that sample identically hash identically, and keep each value's type (1 and 1.0 encode
  differently; proto fields already have fixed types);
- stop strings and stop token ids, as sets (order and repeats do not change where a generation stops).

Left out, because they change only how the output is delivered: the pool (INTERACTIVE or BATCH), `stream`,
the request id, the idempotency key itself and the dedup policy. A retry that moves a request to another pool
is still the same request, not a reused key.

The encoding is canonical JSON (sorted keys, no spaces, no NaN) behind a version tag: changing the
encoding changes the tag, so old and new fingerprints never collide by accident.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

VERSION = "coalesce.fingerprint.v1"

Scalar = bool | int | float | str | None


def fingerprint(
    tenant: str,
    model: str,
    token_ids: Sequence[int],
    sampling: Mapping[str, Scalar],
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
) -> str:
    """Hex SHA-256 of the canonical encoding of a request's payload. Pure; raises ValueError on NaN."""
    payload = [
        VERSION,
        tenant,
        model,
        [int(t) for t in token_ids],
        sorted(sampling.items()),
        sorted(set(stop)),
        sorted({int(t) for t in stop_token_ids}),
    ]
    encoded = json.dumps(payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(encoded.encode()).hexdigest()
