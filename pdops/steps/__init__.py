"""STEPS layer: what every operation's plans are made of, between the reads (what runs now) and the
operations (which steps, in which order, and what a failure undoes).

- ``builders``: the step builders the operations share (pure): connect, preflight, render and deliver,
  start, health, canary, register, the gateways and the front door, verify what runs, a repair's
  lost work and status baseline;
  and the drain sub-plan every change embeds (leave the gateway, wait empty, check twice, the verified
  stop);
- ``actions``: what those steps do on the hosts and the gateways (deliver with Ansible, start the
  gateway, the admission layer and each instance health-gated, register, canary every pair, read
  what runs), called by the executors;
- ``canary``: one short generation through every prefill x decode pair, judged;
- ``stopping``: reading an instance (queues, emptiness) and stopping it by identity, proven; the
  survivors of a stop;
- ``serve``: the executors of serving (connect, preflight, render, deliver, gateways, admission,
  start, health, canary, register, circuit breakers, start-up list, front door, verify what runs,
  undo a failed deploy's registrations);
- ``stop``: the executors of the drain and the verified stop, and of ending a stop's survivors;
- ``record``: the executors that write a revision (deploy, repair, drain), name the work lost with
  an ended process, and move `inv status`'s baseline;
- ``preflight``: the host checks before a start and the P x D pairing probe (its transient
  listener units, started and stopped by it);
- ``targets``: the Prometheus target file of a revision and the `publish-targets` step;
- ``orphans``: ending the orphaned prefill halves pdops.reads.orphans finds (the `end-orphans` step).

Which function carries out each kind of step is in one table, pdops.kinds.KINDS. Imports the reads
and everything below them; the operations, the lab and the CLI import it.
"""
