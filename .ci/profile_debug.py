import sys, collections, os
sys.path.insert(0, os.getcwd())
sys.argv = ["profile_baseline.py", "--random-init", "--batch-size", "2", "--seq-len", "2048", "--use-custom-rmsnorm", "--use-custom-swiglu", "--use-custom-flce"]
import profile_baseline as pb
orig = pb.gpu_rows
def dbg(events):
    c = collections.Counter(); d = collections.Counter()
    for evt in events:
        if evt.device_type != pb.DeviceType.CPU or not evt.kernels or evt.name.startswith("aten::"):
            continue
        for k in evt.kernels:
            if pb.short_kernel_name(k.name) == "at::native::":
                c[(evt.name, evt.cpu_parent.name if evt.cpu_parent else None)] += 1
                d[k.name[:150]] += k.duration
    print("DEBUG parents of at::native:: kernels:", c.most_common(8))
    print("DEBUG kernel names:", d.most_common(5))
    n_cpu_with_kernels = sum(1 for e in events if e.device_type == pb.DeviceType.CPU and e.kernels)
    print("DEBUG events", len(events), "cpu events with kernels", n_cpu_with_kernels)
    return orig(events)
pb.gpu_rows = dbg
pb.main()
