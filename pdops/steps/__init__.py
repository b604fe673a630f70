"""STEPS layer: what every operation's plans are made of, between the reads (what runs now) and the
operations (which steps, in which order, and what a failure undoes).

- ``builders``: the step builders the operations share (pure): connect, preflight, render and deliver,
  start, health, canary, register, the gateways and the front door, verify what runs, a repair's
  lost work and status baseline;
- ``actions``: what those steps do on the hosts and the gateways (deliver with Ansible, start the
  gateway, the admission layer and each instance health-gated, register, canary every pair, read
  what runs), called by the executors;
- ``orphans``: ending the orphaned prefill halves pdops.reads.orphans finds (the `end-orphans` step).

Which function carries out each kind of step is in one table, pdops.kinds.KINDS. Imports the reads
and everything below them; the operations, the lab and the CLI import it.
"""
