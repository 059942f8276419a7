"""The Prefect API a run reports to, and whether it still answers.

A run reports to one Prefect API: the server of PREFECT_API_URL, or the temporary server that
``qerl.flows.runner.start_temporary_server`` starts. Prefect treats that API as part of the run: when
it stops answering, every call the flow engine makes (artifacts, the final state) retries with
exponential back-off, and at exit the event and log workers retry each queued item against it. The
run's own outcome does not depend on it (``run.json`` and the store hold everything), so qerl asks
the API once, briefly, where a call is about to be made and treats a silent API as lost: the run
skips what only the orchestrator would have received and ends with its own outcome (see
``qerl.flows.runner.run`` and ``qerl.flows.cli.entry``).
"""

from __future__ import annotations

import logging

from qerl.pipeline.runtime.errors import cause_chain

log = logging.getLogger("qerl.flow")

_state: dict[str, object] = {"url": None, "lost": False}


def use(url: str | None) -> None:
    """The API this process's runs report to (None: none known, nothing is ever lost)."""
    _state["url"], _state["lost"] = url, False


def url() -> str | None:
    return _state["url"]  # type: ignore[return-value]


def answers(timeout_s: float = 2.0) -> bool:
    """Whether the API answers its health check within ``timeout_s``; a silent one is remembered as
    lost for the rest of the process (it is not asked again). True when no API is known."""
    if _state["url"] is None:
        return True
    if _state["lost"]:
        return False
    import httpx

    try:
        httpx.get(f"{str(_state['url']).rstrip('/')}/health", timeout=timeout_s).raise_for_status()
        return True
    except httpx.HTTPError as err:
        _state["lost"] = True
        log.warning(
            "the Prefect server at %s stopped answering (%s): the run goes on without it", _state["url"], err
        )
        _stop_api_logging()
        return False


def _stop_api_logging() -> None:
    """Detach Prefect's API log handlers: each record would otherwise be retried against the lost
    server and end as a report on the terminal. The records still reach run.log."""
    from prefect.logging.handlers import APILogHandler

    names = list(logging.root.manager.loggerDict)
    for logger in [logging.getLogger(), *(logging.getLogger(name) for name in names)]:
        for handler in list(logger.handlers):
            if isinstance(handler, APILogHandler):
                logger.removeHandler(handler)


def lost() -> bool:
    """Whether the API was found silent (``answers``) in this process."""
    return bool(_state["lost"])


def caused_by_connection(err: BaseException) -> bool:
    """Whether ``err`` or an exception it was raised from is a transport error (no answer at all)."""
    import httpx

    return any(isinstance(e, httpx.TransportError) for e in cause_chain(err))
