import threading
import time

import mlx.core as mx

count = [0]
stop = False
marks = []


def side():
    while not stop:
        count[0] += 1


t = threading.Thread(target=side, daemon=True)
t.start()
time.sleep(0.05)


def measure(fn, label, reps=20):
    rates = []
    durs = []
    for _ in range(reps):
        x = mx.ones((64, 64))
        y = x
        for _ in range(3000):
            y = y * 1.0001 + 0.0001  # lazy graph
        c0 = count[0]
        t0 = time.perf_counter()
        fn(y)
        t1 = time.perf_counter()
        c1 = count[0]
        mx.eval(y)
        durs.append((t1 - t0) * 1e3)
        rates.append((c1 - c0) / max(t1 - t0, 1e-9) / 1e3)
    durs.sort()
    rates.sort()
    print(
        f"{label:12s} call ms p50 {durs[len(durs) // 2]:.3f}  "
        f"side-thread increments per ms p50 {rates[len(rates) // 2]:.0f}"
    )


measure(lambda y: time.sleep(0.005), "sleep 5ms")
measure(lambda y: mx.async_eval(y), "async_eval")
measure(lambda y: mx.eval(y), "eval")


def spin(y):
    e = time.perf_counter() + 0.005
    while time.perf_counter() < e:
        pass


measure(spin, "python spin")
stop = True
