import os, sys, runpy
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.argv = ["bench_paged_attention.py", "--sections", "check_accuracy,check_cuda_graph,time_decode,time_prefill", "--out", os.path.join(os.environ.get("OUT", "."), "pa.json")]
try:
    runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "bench_paged_attention.py"), run_name="__main__")
finally:
    from kernel_regs import report
    report()
