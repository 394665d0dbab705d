from flask import current_app

from sa_jobqueue.default import Job

from . import db, jobqueue
from .mail import send_mail
from .models import User


@jobqueue.tasks.task
def send_welcome(job: Job) -> None:
    user = db.session.get(User, job.payload["user_id"])
    send_mail(current_app.config["MAIL_SENDER"], user.email, "Welcome!")  # at least once: be idempotent
    user.welcomed = True  # commits with the job's completion
