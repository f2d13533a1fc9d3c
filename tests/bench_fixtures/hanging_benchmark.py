"""A benchmark that hangs after starting a helper process, as bench_engine starts vLLM's
server: prints the helper's pid, then waits forever."""

import subprocess
import sys
import time

if __name__ == "__main__":
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"helper pid {helper.pid}", flush=True)
    time.sleep(600)
