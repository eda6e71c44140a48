# shellcheck shell=bash
# Sourced by scripts/install_jetson.sh (its variables and helpers: say, note, warn, die, run).
# The steps that change the system: apt packages, the service user, directories, systemd units,
# ownership, enabling the service.
# shellcheck disable=SC2154  # set by scripts/install_jetson.sh

# Checks: each apt package is installed (dpkg-query); installs only the missing ones (JetPack's
# python3-libnvinfer on a Jetson only).
step_apt() {
    say "apt packages"
    local pkgs=("${APT_PACKAGES[@]}") missing=() p
    if [ "$IS_JETSON" -eq 1 ]; then
        pkgs+=("${APT_JETSON[@]}")
    else
        note "skipped (JetPack only, not a Jetson): ${APT_JETSON[*]}"
    fi
    for p in "${pkgs[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
    done
    if [ ${#missing[@]} -eq 0 ]; then
        note "already installed: ${pkgs[*]}"
        return
    fi
    run apt-get update
    run env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
}

# Checks: the service user exists and is in the groups audio, video (and jtop where that group exists).
step_user() {
    say "service user '$SERVICE_USER' (groups audio, video)"
    local groups=audio,video g
    if getent group jtop >/dev/null 2>&1; then groups="$groups,jtop"; fi
    if id -u "$SERVICE_USER" >/dev/null 2>&1; then
        note "user exists"
    else
        run useradd --system --user-group --home-dir /var/lib/chattts-appliance --no-create-home \
            --shell /usr/sbin/nologin "$SERVICE_USER"
    fi
    for g in ${groups//,/ }; do
        if id -nG "$SERVICE_USER" 2>/dev/null | tr ' ' '\n' | grep -qx "$g"; then
            note "already in group $g"
        else
            run usermod -a -G "$g" "$SERVICE_USER"
        fi
    done
}

# Checks: the install, config, unit, state, spool, output, cache and engine directories exist.
step_dirs() {
    say "directories"
    local d
    for d in "$APP_DIR" "$ETC_DIR" "$UNIT_DIR" "$STATE_DIR" "$STATE_DIR/spool" "$STATE_DIR/out" "$CACHE_DIR" "$ENGINE_DIR"; do
        if [ -d "$d" ]; then note "exists: $d"; else run mkdir -p "$d"; fi
    done
}

# Checks: each unit under systemd/ equals the installed one (paths rewritten for the prefix); replaces only
# those that differ (each written beside it and renamed over it), then systemctl daemon-reload.
step_units() {
    say "systemd units in $UNIT_DIR"
    local u src tmp changed=0
    for u in "${UNITS[@]}"; do
        src="$REPO/systemd/$u"
        [ -f "$src" ] || die "$EXIT_FAIL" "missing unit $src"
        tmp=$(mktemp)
        sed -e "s#/opt/chattts-appliance#$APP_DIR#g" -e "s#/etc/chattts-appliance#$ETC_DIR#g" "$src" >"$tmp"
        if [ -f "$UNIT_DIR/$u" ] && cmp -s "$tmp" "$UNIT_DIR/$u"; then
            note "unchanged: $u"
        elif [ "$DRY_RUN" -eq 1 ]; then
            printf '+ install -m 0644 %q %q   # paths under %s\n' "$src" "$UNIT_DIR/.$u.new" "${P:-/}"
            printf '+ mv -f %q %q\n' "$UNIT_DIR/.$u.new" "$UNIT_DIR/$u"
            changed=1
        else
            # written beside it, then renamed over it: systemd never reads half a unit
            run install -m 0644 "$tmp" "$UNIT_DIR/.$u.new"
            run mv -f "$UNIT_DIR/.$u.new" "$UNIT_DIR/$u"
            changed=1
        fi
        rm -f "$tmp"
    done
    if [ "$SYSTEM" -eq 1 ] && [ "$changed" -eq 1 ]; then run systemctl daemon-reload; fi
}

# Checks: nothing (idempotent): the state and cache directories belong to the service user.
step_owner() {
    say "ownership of $STATE_DIR and $CACHE_DIR"
    run chown -R "$SERVICE_USER:$SERVICE_USER" "$STATE_DIR" "$CACHE_DIR"
}

# Checks: --no-enable; enables and starts the service and the health timer.
step_enable() {
    say "enable the service"
    if [ "$ENABLE" -eq 0 ]; then
        note "skipped (--no-enable)"
        return
    fi
    run systemctl enable --now chattts-appliance.service chattts-appliance-health.timer
}
