import bisect
import os
import statistics
import threading
import time


def run(wait_kind, pin=None, reps=300, busy_ms=(0.5, 1.0)):
    stamps = []
    done = False
    fd = None
    if wait_kind == "cold":
        path = str(
            __import__("pathlib").Path(__file__).resolve().parents[3]
            / "models"
            / "tiny-trained-stream"
        )
        files = [
            os.path.join(path, f)
            for f in sorted(os.listdir(path))
            if f.endswith(".safetensors") or f.endswith(".bin")
        ]
        fn = max(files, key=os.path.getsize)
        fd = os.open(fn, os.O_RDONLY)
        size = os.fstat(fd).st_size

    def waiter():
        if pin:
            os.sched_setaffinity(0, {pin[1]})
        i = 0
        while not done:
            if wait_kind == "nap":
                time.sleep(0.0001)
            else:
                off = (i * 7919 * 4096) % (size - 4096)
                off -= off % 4096
                i += 1
                os.posix_fadvise(fd, off, 4096, os.POSIX_FADV_DONTNEED)
                os.pread(fd, 4096, off)
            stamps.append(time.perf_counter_ns())

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    if pin:
        os.sched_setaffinity(0, {pin[0]})
    rel = []
    for i in range(reps * len(busy_ms)):
        end = time.perf_counter_ns() + int(busy_ms[i % 2] * 1e6)
        while time.perf_counter_ns() < end:
            pass
        rel.append(time.perf_counter_ns())
        time.sleep(0.002)
    done = True
    t.join()
    if pin:
        os.sched_setaffinity(0, {0, 1})
    out = []
    for r in rel:
        j = bisect.bisect_right(stamps, r)
        if j < len(stamps):
            out.append((stamps[j] - r) / 1e6)
    out.sort()
    return (
        round(statistics.median(out), 4),
        round(out[len(out) // 10], 4),
        round(out[9 * len(out) // 10], 4),
    )


for rnd in range(2):
    for kind, pin in (
        ("nap", None),
        ("nap", (0, 1)),
        ("nap", (0, 0)),
        ("cold", None),
        ("cold", (0, 1)),
    ):
        print(rnd, kind, pin, "p50/p10/p90", run(kind, pin))
