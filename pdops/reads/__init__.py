"""READS layer: what the cluster runs now and what happened, read and judged, changing nothing.

Observation (``observe``: systemd, the gateway, identities), orphaned halves, verify, status and
history; it starts, stops and sends nothing (the preflight, whose pairing probe starts transient
listeners, is pdops.steps.preflight; the admission audit, which sends its own requests, is
pdops.ops.audit). Imports the record, the connections and the model; never a step or an operation."""
