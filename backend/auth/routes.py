"""HTTP routes for projects and tokens."""

from __future__ import annotations

from fastapi import APIRouter, HTTPException

from backend.auth import service
from backend.auth.models import Role
from backend.auth.schemas import ProjectOut, TokenCreate, TokenCreated, TokenOut, WhoAmI
from backend.deps import Admin, CurrentPrincipal, ReadSessionDep, SessionDep
from backend.fields import TokenIdPath

router = APIRouter(tags=["auth"])


@router.get("/projects", response_model=list[ProjectOut])
def list_projects(principal: CurrentPrincipal, db_session: ReadSessionDep) -> list[ProjectOut]:
    """The projects the token can see: tokens belong to one project."""
    project = service.get_project(db_session=db_session, project_id=principal.project_id)
    return [ProjectOut.model_validate(project)] if project else []


@router.get("/whoami", response_model=WhoAmI)
def whoami(principal: CurrentPrincipal) -> WhoAmI:
    """The token's project and role."""
    return WhoAmI(
        project=principal.project_name,
        project_id=principal.project_id,
        token_name=principal.token_name,
        role=principal.role.value,
        run_id=principal.run_id,
    )


@router.get("/tokens", response_model=list[TokenOut])
def list_tokens(principal: Admin, db_session: ReadSessionDep) -> list[TokenOut]:
    """The project's tokens (never their secrets); run-scoped tokens are left out."""
    return [TokenOut.model_validate(t) for t in service.list_tokens(db_session=db_session, project_id=principal.project_id)]


@router.post("/tokens", response_model=TokenCreated, status_code=201)
def create_token(body: TokenCreate, principal: Admin, db_session: SessionDep) -> TokenCreated:
    """A new token for the project; the secret is in this answer only."""
    row, value = service.create_token(
        db_session=db_session,
        project_id=principal.project_id,
        name=body.name,
        role=Role(body.role),
        expires_in_s=body.expires_in_s,
    )
    db_session.commit()
    return TokenCreated(**TokenOut.model_validate(row).model_dump(), token=value)


@router.delete("/tokens/{token_id}", response_model=TokenOut)
def revoke_token(token_id: TokenIdPath, principal: Admin, db_session: SessionDep) -> TokenOut:
    """Revoke a token: it stops working at once."""
    tok = service.revoke_token(db_session=db_session, project_id=principal.project_id, token_id=token_id)
    if tok is None:
        raise HTTPException(404, f"token {token_id} not found")
    db_session.commit()
    return TokenOut.model_validate(tok)
