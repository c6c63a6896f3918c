"""Webhooks: an owner's URLs, signed POSTs when their jobs end or raise a red health flag, and every
delivery attempt visible (service/core/webhooks.py says what is sent, how it is signed and retried)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Path, Query, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from service.api.deps import MAX_INT, OwnerDep, SessionDep, SettingsDep
from service.api.schemas import error_responses
from service.core import webhooks as hooks
from service.core.errors import format_errors
from service.core.grader_urls import UrlRefused, check_url
from service.core.spec_base import _Section
from service.store import webhooks as webhooks_q

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"], responses=error_responses(401, 422, 503))
WebhookId = Annotated[int, Path(ge=1, le=MAX_INT, description="Webhook id.")]


class WebhookIn(_Section):
    url: str = Field(max_length=2000, description="Where deliveries are POSTed: under an entry of the admin's "
                     "allow-list (GRPO_WEBHOOK_URLS), compared by scheme, host, port and path segments.")
    events: list[Literal[hooks.EVENT_TYPES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: list(hooks.EVENT_TYPES), min_length=1, max_length=len(hooks.EVENT_TYPES),
        description="The events it is sent: job.succeeded, job.failed, job.cancelled, job.health (a red guard).")


class WebhookOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int
    url: str  # canonical form: what is called
    events: list[str]
    created_at: datetime


class WebhookCreated(WebhookOut):
    secret: str = Field(description="The HMAC-SHA256 key of this webhook's signatures. Shown only here: keep it.")


class DeliveryOut(BaseModel):
    model_config = ConfigDict(from_attributes=True)

    id: int  # the Grpo-Webhook-Id header: the same on every retry
    job_id: int
    event: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    next_attempt_at: datetime | None  # pending only
    last_status: int | None  # the last answer's HTTP status
    last_error: str | None
    created_at: datetime
    delivered_at: datetime | None
    payload: dict[str, Any]


def _mine(session, owner: str, webhook_id: int):
    hook = webhooks_q.get_webhook(session, owner=owner, webhook_id=webhook_id)
    if hook is None:
        raise HTTPException(404, f"no webhook {webhook_id}")
    return hook


@router.post("", status_code=201, response_model=WebhookCreated, responses=error_responses(409, 413))
def create_webhook(body: WebhookIn, owner: OwnerDep, session: SessionDep, settings: SettingsDep):
    """Register a URL; the answer holds its signing secret, which is never shown again."""
    try:
        url = check_url(body.url, settings.webhook_urls, "GRPO_WEBHOOK_URLS", "webhooks")
    except UrlRefused as exc:
        return JSONResponse(format_errors([{"loc": ("body", "url"), "type": "value_error", "msg": f"url {exc}"}]),
                            status_code=422)
    if webhooks_q.count_webhooks(session, owner=owner) >= hooks.MAX_PER_OWNER:
        raise HTTPException(409, f"an owner may have {hooks.MAX_PER_OWNER} webhooks: delete one first")
    hook = webhooks_q.create_webhook(session, owner=owner, url=str(url), events=list(dict.fromkeys(body.events)))
    return WebhookCreated.model_validate({**WebhookOut.model_validate(hook).model_dump(), "secret": hook.secret})


@router.get("", response_model=list[WebhookOut])
def list_webhooks(owner: OwnerDep, session: SessionDep):
    return webhooks_q.list_webhooks(session, owner=owner)


@router.delete("/{webhook_id}", status_code=204, response_class=Response, responses=error_responses(404, 413))
def delete_webhook(webhook_id: WebhookId, owner: OwnerDep, session: SessionDep) -> Response:
    """Delete a webhook and its deliveries (pending ones are not sent)."""
    webhooks_q.delete_webhook(session, hook=_mine(session, owner, webhook_id))
    return Response(status_code=204)


@router.get("/{webhook_id}/deliveries", response_model=list[DeliveryOut], responses=error_responses(404))
def list_deliveries(webhook_id: WebhookId, owner: OwnerDep, session: SessionDep,
                    after: Annotated[int, Query(ge=0, le=2**62, description="Cursor: the last delivery id seen.")] = 0,
                    limit: Annotated[int, Query(ge=1, le=500)] = 100):
    """Every delivery of the webhook, oldest first: its status, attempts, the last answer or error."""
    hook = _mine(session, owner, webhook_id)
    return [DeliveryOut.model_validate({**DeliveryOut.model_validate(d).model_dump(),
                                        "next_attempt_at": d.next_attempt_at if d.status == "pending" else None})
            for d in webhooks_q.list_deliveries(session, webhook_id=hook.id, after=after, limit=limit)]
