"""A torchtune-style activation offloader, written here as the bench's
reference (bench/bench_gpu.py's "torchtune-style offload" row).

What torchtune's ``OffloadActivations`` does, in short: saved-tensor hooks
that copy every saved CUDA tensor of at least ``min_bytes`` (parameters
aside) to pinned host memory on a side stream, keep the device tensor until
that copy's event completed (no ``record_stream``), and in backward copy each
one back on the side stream, the consuming stream waiting on its event, with
the next one (in reverse order) prefetched. Pinned memory comes from torch's
caching host allocator, one tensor per saved tensor. It decides nothing per
op: everything saved in the hooks' scope goes to the host.

On a CPU tensor it keeps the tensor as is (there is no host to offload to).
"""

import torch


class OffloadEverything(torch.autograd.graph.saved_tensors_hooks):
    def __init__(self, min_bytes=1 << 20):
        self.min_bytes = min_bytes
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.next_id = 0
        self.copying = {}  # id -> (device tensor, event): held until the copy is done
        self.hosts = {}  # id -> host tensor (weakly: the packed tuple owns it)
        self.prefetched = {}  # id -> (device tensor, event)
        super().__init__(self.pack, self.unpack)

    def _drain(self):
        for k in [k for k, (_, ev) in self.copying.items() if ev.query()]:
            del self.copying[k]

    def pack(self, t):
        if (
            not t.is_cuda
            or isinstance(t, torch.nn.Parameter)
            or t.numel() * t.element_size() < self.min_bytes
        ):
            return ("kept", t)
        self._drain()
        ident = self.next_id
        self.next_id += 1
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
            event = self.stream.record_event()
        self.copying[ident] = (t, event)
        self.hosts[ident] = host
        return ("offloaded", ident, host)

    def _copy_in(self, host):
        current = torch.cuda.current_stream()
        dev = torch.empty(host.shape, dtype=host.dtype, device="cuda")  # on the consumer's stream
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            dev.copy_(host, non_blocking=True)
            event = self.stream.record_event()
        return dev, event

    def unpack(self, packed):
        if packed[0] == "kept":
            return packed[1]
        _, ident, host = packed
        if ident in self.copying:  # its copy out is still running: the original
            return self.copying[ident][0]
        dev, event = self.prefetched.pop(ident, None) or self._copy_in(host)
        torch.cuda.current_stream().wait_event(event)
        # Prefetch the one before it (backward runs in reverse order).
        before = self.hosts.get(ident - 1)
        if before is not None and ident - 1 not in self.prefetched:
            self.prefetched[ident - 1] = self._copy_in(before)
        self.hosts.pop(ident, None)
        return dev
