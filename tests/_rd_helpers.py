"""A rate-distortion report from given figures, shared by the eval and CLI tests (no measurement)."""
from fibquant.eval.rate_distortion import Point, RDConfig, RDReport, check_targets


def rd_report(fib_mse: float, encode_ratio: float) -> RDReport:
    """A d = 64 report whose FibQuant 2-bit MSE is `fib_mse` and encode ratio `encode_ratio`."""
    report = RDReport(RDConfig(dims=(64,)))
    report.points = [Point("FibQuant", 64, 2.0, 2.25, fib_mse, 4, 256, best=True),
                     Point("FibQuant", 64, 2.0, 2.25, 0.2, 2, 16),
                     Point("TurboQuant", 64, 2, 2.25, 0.1, 1, 4),
                     Point("FibQuant", 64, 0.5, 0.75, 0.58, 16, 256, best=True)]
    report.throughput = [{"dim": 64, "bits": 2, "fibquant": "k=4 N=256", "encode_ratio": encode_ratio,
                          "decode_ratio": 1.0, "fib_encode_vps": 1.0, "fib_decode_vps": 1.0,
                          "turbo_encode_vps": 1.0, "turbo_decode_vps": 1.0, "threads": 1}]
    report.targets = check_targets(report)
    return report
