"""``python -m services.prompt_stage module.path:ClassName``"""

from services.prompt_stage.worker import main_entry

if __name__ == "__main__":
    main_entry()
