"""stub"""
from hetsim.types import MemoryBreakdown


def data_parallel_memory(cost, dev, micro, precision, ckpt, **kw):
    return MemoryBreakdown(other_bytes=1)
def zero1_owned_counts(cost, n):
    return [cost.param_count() // n] * n
def batchnorm_warning(*a):
    return None
