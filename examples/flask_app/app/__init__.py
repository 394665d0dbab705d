import os

from flask import Flask
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import DeclarativeBase

from sa_jobqueue import psycopg_url
from sa_jobqueue.contrib.flask import JobQueue


class Base(DeclarativeBase):
    pass


db = SQLAlchemy(model_class=Base)
jobqueue = JobQueue()  # the default job table, sa_jobqueue_jobs


def create_app() -> Flask:
    app = Flask(__name__)
    # psycopg 3 drives the queue: postgresql+psycopg://…
    app.config["SQLALCHEMY_DATABASE_URI"] = psycopg_url(os.environ["DATABASE_URL"]).render_as_string(
        hide_password=False
    )
    app.config["MAIL_SENDER"] = "welcome@example.com"
    db.init_app(app)
    jobqueue.init_app(app, db)  # after db.init_app

    from . import jobs, views  # noqa: F401  (jobs: its @jobqueue.tasks.task handlers register on import)

    app.register_blueprint(views.bp)
    return app
