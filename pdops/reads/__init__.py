"""READS layer: what the cluster runs now and what happened, read and judged, changing nothing.

Observation (``observe``: systemd, the gateway, identities), orphaned halves, preflight, verify,
status, history and the admission audit. Imports the record, the connections and the model;
never an operation (``pdops.ops``)."""
