"""MODEL layer: what a cluster is, computed without contacting anything.

The inventory (read, validated), topologies, placement, the rendered files, the gateway's
start-up list, the admission and Prometheus settings, the pinned versions, sizing arithmetic and
the check of rendered commands with SGLang's own parser. Imports only ``pdops.errors``,
``pdops.facts`` and itself; never a connection (the `model-reaches-no-host` contract in
``.importlinter``)."""
