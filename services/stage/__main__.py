"""``python -m services.stage module.path:ClassName``"""

from services.stage.worker import main_entry

if __name__ == "__main__":
    main_entry()
