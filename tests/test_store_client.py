"""The S3 client's pure parts (trainer/storage/object/obstore_client.py, client.py): how
object_store's errors are read by the retry policy, and that a retry's jitter leaves Python's
global generator (training state) alone. The client against a real server: test_store*.py."""

from __future__ import annotations

import random

import pytest

from trainer.config import StoreConfig
from trainer.location import StoreLocation
from trainer.storage.object.client import StoreAccessDenied, StoreCalls, StoreUnavailable, is_transient

obstore = pytest.importorskip("obstore")

SLOW_DOWN = ("Generic S3 error: Error performing PUT http://127.0.0.1:1/b/run/x in 2ms - Server returned non-2xx "
             "status code: 503 Service Unavailable: <?xml version=\"1.0\"?><Error><Code>SlowDown</Code>"
             "<Message>Please reduce your request rate.</Message></Error>")
FORBIDDEN = ("Generic S3 error: Error performing GET http://127.0.0.1:1/b?list-type=2&X-Amz-Signature=abc123 in 1ms - "
             "Server returned non-2xx status code: 403 Forbidden: <?xml?><Error><Code>SignatureDoesNotMatch</Code>")


def test_throttling_is_transient_and_named_a_refusal_is_not_and_no_signature_is_shown():
    from obstore.exceptions import GenericError

    from trainer.storage.object.obstore_client import refined
    throttled = refined(GenericError(SLOW_DOWN))
    assert is_transient(throttled) and str(throttled) == "503 Service Unavailable SlowDown"
    refused = refined(GenericError(FORBIDDEN))
    assert isinstance(refused, PermissionError) and "SignatureDoesNotMatch" in str(refused)
    assert "abc123" not in str(refused)
    assert isinstance(refined(GenericError("x Unable to locate credentials y")), PermissionError)


class Flaky(StoreCalls):
    def __init__(self, failures: list[BaseException]):
        super().__init__(StoreLocation("s3", "b", "run"), StoreConfig(retries=2, backoff_s=0.001))
        self.failures = failures

    def attempt(self):
        if self.failures:
            raise self.failures.pop(0)
        return "done"


def test_a_retry_draws_its_jitter_from_its_own_generator_not_the_training_state():
    random.seed(7)
    before = random.getstate()
    flaky = Flaky([ConnectionError("503 SlowDown"), ConnectionError("503 SlowDown")])
    assert flaky.call("writing x", flaky.attempt) == "done"
    assert random.getstate() == before


def test_the_bounds_hold_and_a_refusal_is_not_retried():
    exhausted = Flaky([ConnectionError("503 SlowDown")] * 3)
    with pytest.raises(StoreUnavailable, match="failed after 3 tries"):
        exhausted.call("writing x", exhausted.attempt)
    refused = Flaky([PermissionError("403 Forbidden"), ConnectionError("never reached")])
    with pytest.raises(StoreAccessDenied):
        refused.call("reading x", refused.attempt)
    assert len(refused.failures) == 1
