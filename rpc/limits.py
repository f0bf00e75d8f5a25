"""Message size limits every process shares (a constant, not logic: the protocol's one shared number).

Internal calls (control plane <-> workers, the DedupService, clients reading batch results) carry big
messages: a real tokenizer is several MB, over gRPC's default 4 MiB receive limit.
"""

INTERNAL_MESSAGE_BYTES = 64 * 1024 * 1024
INTERNAL_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", INTERNAL_MESSAGE_BYTES),
    ("grpc.max_send_message_length", INTERNAL_MESSAGE_BYTES),
]
