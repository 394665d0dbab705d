from flask import Blueprint, request

from . import db
from .jobs import send_welcome
from .models import User

bp = Blueprint("views", __name__)


@bp.post("/signup")
def signup():
    user = User(email=request.form["email"])
    db.session.add(user)
    db.session.flush()  # the user's id
    job = send_welcome.enqueue(db.session, user.id)  # on queue "signup", the task's
    db.session.commit()  # the user and the job, together
    return {"user_id": user.id, "job_id": job.id}, 201
