"""The kernel: the rules and formats every other part of threadlog builds on.

What belongs here: the error codes (`errors`), the input and checkpoint rules
(`validation`, `checkpoint_rules`), the one owner of each record format
(`records`, `delivery_records`), the namespace's topics (`topics`), the
librdkafka settings of every client (`kafka_config`) and key -> partition
(`partitioning`). The judge, the projections, the producers, the client and
its edges all import these; the client runs the same rules before sending as
the judge does on what arrives.

The rule: a kernel module imports only the standard library, third-party
packages and other kernel modules -- never anything else of `threadlog`
(tests/unit/test_layering.py checks it). A rule that needs more than that
belongs above the kernel.
"""
