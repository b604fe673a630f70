"""One error hierarchy for pdops. The CLI maps each kind to one message and exit status."""

from __future__ import annotations


class PdopsError(Exception):
    """Root of every error pdops raises on purpose."""

    exit_code = 1
    kind = "error"

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


class RemoteCommandFailed(PdopsError):
    """A command on a host exited non-zero; carries host, command, exit code and output tail."""

    exit_code = 6
    kind = "remote command failed"

    def __init__(self, host: str, command: str, exit_code: int, output: str = ""):
        tail = "\n".join(output.rstrip().splitlines()[-20:])
        super().__init__(f"{host}: `{command}` exited {exit_code}", evidence=tail or None)
        self.host = host
        self.command = command
        self.returncode = exit_code
        self.output = output
