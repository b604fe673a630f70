# Runs with the engine's python on a host, sent by pdops.facts.host.versions_command as `python -c`:
# argv[1] the package names (JSON), then `torch-nccl` to read NCCL from torch when no wheel has it.
import importlib.metadata as m, json, sys
names = json.loads(sys.argv[1])
out = {}
for n in names:
    try:
        out[n] = m.version(n)
    except Exception:
        out[n] = None
if 'torch-nccl' in sys.argv[1:] and not (out['nvidia-nccl-cu12'] or out['nvidia-nccl-cu13']):
    try:
        import torch
        v = torch.cuda.nccl.version()
        out['torch.cuda.nccl'] = '.'.join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception as e:
        out['torch.cuda.nccl'] = None
        out['torch.cuda.nccl.error'] = str(e)[:200]
print(json.dumps(out))
