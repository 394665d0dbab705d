from flask import current_app

from . import db, jobqueue
from .mail import send_mail
from .models import User


@jobqueue.tasks.task(queue="signup")
def send_welcome(user_id: int) -> None:
    user = db.session.get(User, user_id)  # db.session is the job's session here
    send_mail(current_app.config["MAIL_SENDER"], user.email, "Welcome!")  # at least once: be idempotent
    user.welcomed = True  # commits with the job's completion
