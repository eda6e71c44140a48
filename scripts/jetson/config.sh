# shellcheck shell=bash
# Sourced by scripts/install_jetson.sh (its variables and helpers: say, note, warn, die, run).
# The box's config and checkpoint.
# shellcheck disable=SC2154  # set by scripts/install_jetson.sh

# set_key FILE SECTION KEY VALUE: replace '  KEY: ...' inside top-level 'SECTION:' (comments kept).
set_key() {
    local file=$1 section=$2 key=$3 value=$4 tmp
    tmp=$(mktemp "$file.XXXXXX")     # beside it: the mv below is a rename, not a copy
    awk -v s="$section" -v k="$key" -v v="$value" '
        /^[A-Za-z_]+:/ { cur = $1; sub(":.*", "", cur) }
        cur == s && $0 ~ "^  " k ":" && !done { sub(":[^#]*", ": " v "   "); done = 1 }
        { print }
        END { if (!done) exit 3 }' "$file" >"$tmp" || { rm -f "$tmp"; die "$EXIT_FAIL" "config template has no $section.$key"; }
    mv "$tmp" "$file"
}

# Checks: the config template validates with the installed package; an existing config is never
# overwritten (the new template goes to config.yaml.dist).
step_config() {
    say "config $CONFIG"
    local dist="$CONFIG.dist"
    if [ "$DRY_RUN" -eq 1 ]; then
        printf '+ write %s from %s (model.path=%s, model.engine_dir=%s, service.spool_dir, audio.wav_dir under %s, safety.cache_dir)\n' \
            "$dist" "$REPO/config.yaml" "$MODEL_DIR" "$ENGINE_DIR" "$STATE_DIR"
        if [ -f "$CONFIG" ]; then note "keeping the existing $CONFIG"; else printf '+ cp %q %q\n+ mv -f %q %q\n' "$dist" "$CONFIG.new" "$CONFIG.new" "$CONFIG"; fi
        return
    fi
    cp "$REPO/config.yaml" "$dist"
    set_key "$dist" model path "$MODEL_DIR"
    set_key "$dist" model engine_dir "$ENGINE_DIR"
    set_key "$dist" service spool_dir "$STATE_DIR/spool"
    set_key "$dist" audio wav_dir "$STATE_DIR/out"
    set_key "$dist" safety cache_dir "$CACHE_DIR"
    sed -i "1i # Written by scripts/install_jetson.sh from $REPO/config.yaml; edit freely (kept on re-install)." "$dist"
    if [ -f "$CONFIG" ]; then
        note "keeping the existing config; the current template is $dist"
    else
        # written beside it, then renamed: a daemon (re)starting meanwhile never reads half a config
        run cp "$dist" "$CONFIG.new"
        run mv -f "$CONFIG.new" "$CONFIG"
    fi
    if [ -x "$VENV/bin/python" ]; then
        "$VENV/bin/python" -c 'import sys; from appliance.config import load_config; load_config(sys.argv[1])' "$CONFIG" ||
            die "$EXIT_FAIL" "$CONFIG does not validate (see the message above)"
        note "config validates"
    fi
}

# Checks: the checkpoint's asset/gpt/config.json is present (else it is fetched, unless --skip-model).
step_model() {
    say "checkpoint $MODEL_DIR"
    if [ -f "$MODEL_DIR/asset/gpt/config.json" ]; then
        note "present"
    elif [ "$SKIP_MODEL" -eq 1 ]; then
        warn "no checkpoint at $MODEL_DIR (--skip-model): put the 2Noise/ChatTTS asset/ there before starting"
    else
        note "weights: 2Noise/ChatTTS, licence CC BY-NC 4.0 (non-commercial use only)"
        run "$CLI" model fetch "$MODEL_DIR"
    fi
}
