"""Every stable reason and error string of the client contract (docs/protocol.md), in one place.

Pure constants with no imports, so the pure scheduler and admission can use
them without pulling in sockets or msgpack.
"""

# admission
ADMITTED = "ADMITTED"
QUEUED = "QUEUED"
REJECTED_QUEUE_FULL = "REJECTED_QUEUE_FULL"
REJECTED_KV_BUDGET = "REJECTED_KV_BUDGET"
REJECTED_SCRATCH_BUDGET = "REJECTED_SCRATCH_BUDGET"
REJECTED_DUPLICATE = "REJECTED_DUPLICATE"
REJECTED_CONTEXT_TOO_LONG = "REJECTED_CONTEXT_TOO_LONG"
REJECTED_RECIPE_MISMATCH = "REJECTED_RECIPE_MISMATCH"
REJECTED_BAD_REQUEST = "REJECTED_BAD_REQUEST"
REJECTED_DRAINING = "REJECTED_DRAINING"
REJECTED_MEMORY_PRESSURE = "REJECTED_MEMORY_PRESSURE"
REJECTIONS = (REJECTED_QUEUE_FULL, REJECTED_KV_BUDGET, REJECTED_SCRATCH_BUDGET, REJECTED_DUPLICATE,
              REJECTED_CONTEXT_TOO_LONG, REJECTED_RECIPE_MISMATCH, REJECTED_BAD_REQUEST,
              REJECTED_DRAINING, REJECTED_MEMORY_PRESSURE)

# session states in the `admitted` event
RUNNING = "RUNNING"

# done
LENGTH = "LENGTH"
EOS = "EOS"
STOP = "STOP"
CANCELLED = "CANCELLED"
CACHE_MISS = "CACHE_MISS"
ENGINE_ERROR = "ENGINE_ERROR"
DRAINED = "DRAINED"
EMBEDDED = "EMBEDDED"  # extension: an embedding session's vector was sent (its `embedding` event)
EXPORTED = "EXPORTED"  # extension: the client took the session elsewhere (`export`; its `exported` came first)

# error event codes
BAD_REQUEST = "BAD_REQUEST"
UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
UNKNOWN_SESSION = "UNKNOWN_SESSION"
TOO_LARGE = "TOO_LARGE"

# extension (docs/protocol.md): BAD_REQUEST is also a `done` reason, for a session whose own request turned out
# never to be able to complete while it ran (its response_format failed: the constraint library's limits, or no
# token can continue the output); `detail` gives the library's words
KV_UNTRUSTED = (CACHE_MISS, ENGINE_ERROR, BAD_REQUEST)  # a session ended so leaves no KV worth caching

# extension (documented in docs/protocol.md): the engine is in a crash loop and the node is unhealthy
REJECTED_ENGINE_UNAVAILABLE = "REJECTED_ENGINE_UNAVAILABLE"
REJECTIONS = REJECTIONS + (REJECTED_ENGINE_UNAVAILABLE,)

# every reason a `done` may carry (a queued session displaced or refused later ends with its rejection's)
DONE_REASONS = frozenset({LENGTH, EOS, STOP, CANCELLED, CACHE_MISS, ENGINE_ERROR, DRAINED, EMBEDDED, EXPORTED,
                          BAD_REQUEST, *REJECTIONS})
