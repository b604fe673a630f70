"""One error hierarchy for pdops, and the one exit-status table. The CLI maps each kind to one
message and its exit status; the README's table is checked against :data:`EXIT_STATUSES`."""

from __future__ import annotations


class PdopsError(Exception):
    """Root of every error pdops raises on purpose."""

    exit_code = 1
    kind = "error"
    journal_evidence: dict | None = None  # structured evidence the runner journals with the failed step
    # the line the failed plan's failure line wrote after its rescue (pdops.runner.walk_body), added to
    # the message once the failure itself is journalled (:meth:`add_verdict_line`)
    verdict_line: str | None = None

    def add_verdict_line(self) -> None:
        """The failed plan's verdict line, added to the message the operator reads (once)."""
        if self.verdict_line:
            self.message += "\n" + self.verdict_line
            self.verdict_line = None

    def __init__(self, message: str, *, fix: str | None = None, evidence: str | None = None):
        super().__init__(message)
        self.message = message
        self.fix = fix
        self.evidence = evidence

    def render(self) -> str:
        lines = [f"{self.kind}: {self.message}"]
        if self.fix:
            lines.append(f"  fix: {self.fix}")
        if self.evidence:
            lines.append("  evidence:")
            lines.extend("    " + ln for ln in self.evidence.rstrip().splitlines())
        return "\n".join(lines)


class InvalidInput(PdopsError):
    """Operator input (topology, inventory, flags) is wrong. Raised before any host is touched."""

    exit_code = 2
    kind = "invalid input"

    def __init__(self, field: str, message: str, *, fix: str | None = None):
        super().__init__(f"{field}: {message}", fix=fix)
        self.field = field


class Unreachable(PdopsError):
    """A host, engine or gateway did not answer."""

    exit_code = 3
    kind = "unreachable"


class Refused(PdopsError):
    """A safety rule refuses the operation (last instance of a role, lock held, ...)."""

    exit_code = 4
    kind = "refused"


class Unverified(PdopsError):
    """An operation ran but its outcome could not be proven."""

    exit_code = 5
    kind = "unverified"


def short_command(command: str, limit: int = 100) -> str:
    """A command as a message shows it: its first line, at most `limit` characters (pdops's host
    scripts travel as `python3 -c <the whole script>`, which would fill a screen)."""
    first = command.strip().splitlines()[0] if command.strip() else ""
    cut = first if len(first) <= limit else first[:limit]
    return cut + (" ..." if cut != command.strip() else "")


class RemoteCommandFailed(PdopsError):
    """A command on a host exited non-zero; carries host, command, exit code and output tail."""

    exit_code = 6
    kind = "remote command failed"

    def __init__(self, host: str, command: str, exit_code: int, output: str = ""):
        tail = "\n".join(output.rstrip().splitlines()[-20:])
        super().__init__(f"{host}: `{short_command(command)}` exited {exit_code}", evidence=tail or None)
        self.host = host
        self.command = command
        self.returncode = exit_code
        self.output = output


class PlaybookFailed(PdopsError):
    """ansible-playbook failed on a host (its recap and output tail are the evidence)."""

    exit_code = 10
    kind = "ansible failed"


class DeployFailed(PdopsError):
    """A deploy stopped at a failed step; `current` did not move."""

    exit_code = 7
    kind = "deploy failed"


class DrainFailed(PdopsError):
    """A drain stopped before its stop (deadline, work found by an empty check); the instance runs."""

    exit_code = 8
    kind = "drain stopped"


class ScaleFailed(PdopsError):
    """A scale or rollback stopped; what it added was undone, or a partial revision records what is live."""

    exit_code = 9
    kind = "scale stopped"


def exit_statuses() -> dict[int, str]:
    """{exit status: kind} for every error class; each status means one thing."""
    table: dict[int, str] = {}
    todo = [PdopsError]
    while todo:
        cls = todo.pop()
        todo += cls.__subclasses__()
        if cls.__dict__.get("exit_code") is None and cls is not PdopsError:
            continue  # a subclass that keeps its parent's status (e.g. StopUnverified)
        prev = table.get(cls.exit_code)
        if prev is not None and prev != cls.kind:
            raise AssertionError(f"exit status {cls.exit_code} means both {prev!r} and {cls.kind!r}")
        table[cls.exit_code] = cls.kind
    return dict(sorted(table.items()))


def one_of(names, value: object, what: str = "host", shown: int = 3, of: str = "this inventory") -> str:
    """A fix that names a few valid choices, the closest to `value` first, and how many there are:
    readable for a 256-host inventory, where listing every name is not."""
    import difflib

    names = list(names)
    if len(names) <= shown + 2:
        return f"use one of: {', '.join(names)}"
    close = difflib.get_close_matches(str(value), names, n=shown, cutoff=0.0) if isinstance(value, str) else []
    picks = close or names[:shown]
    return f"use one of the {len(names)} {what}s of {of} (closest: {', '.join(picks)})"
